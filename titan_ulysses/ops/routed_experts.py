"""What expert parallelism relies on of a mixture's experts: :class:`RoutedExperts`.

``distributed/expert_parallel.py`` shards the experts' weights over the ``ep`` ranks and runs
this rank's experts on the rows it receives; the decoder's experts (``models/moe/experts.py``)
derive from this base class, so neither side imports the other. A base class, not a
``typing.Protocol``: ``isinstance`` answers the same on every Python (from 3.12 a Protocol's
data members are looked up with ``inspect.getattr_static``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RoutedExperts"]


class RoutedExperts(nn.Module):
    """``E`` experts whose parameters registered on the module itself are each ``[E, ...]`` (expert first:
    expert parallelism shards them along dim 0, under their own names).

    ``forward(x [T', D] rows grouped by expert in expert order, counts [E]) -> [T', D]`` is
    ``run(x, counts, *expert_weights())``; expert parallelism calls ``run`` with its local shards.
    A subclass sets ``num_experts`` (all experts, before any sharding) and implements the two methods.
    """

    num_experts: int

    def expert_weights(self) -> tuple[torch.Tensor | None, ...]:
        """The weights ``run`` takes, in its order (None for one the experts lack)."""
        raise NotImplementedError(f"{type(self).__name__} derives from RoutedExperts but has no expert_weights()")

    def run(self, x: torch.Tensor, counts: torch.Tensor, *weights: torch.Tensor | None) -> torch.Tensor:
        """The experts as a function of their weights: ``x`` [T', D], ``counts`` [E_local] -> [T', D]."""
        raise NotImplementedError(f"{type(self).__name__} derives from RoutedExperts but has no run()")

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.run(x, counts, *self.expert_weights())
