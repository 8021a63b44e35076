"""What code outside the decoder may rely on of an attention module: :class:`HeadAttention`.

``distributed/staged_attention.py`` recomputes a layer head group by head group through it, and
Ulysses and cp swap its ``inner_attention`` (the backend contract of this package's
``__init__``). It is a base class, not a ``typing.Protocol`` with data members: from Python
3.12 ``isinstance`` against such a Protocol looks members up with ``inspect.getattr_static``,
which does not see the submodules ``nn.Module`` keeps in ``_modules``, so the answer would
change with the interpreter. A subclass check answers the same on every Python.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

__all__ = ["HeadAttention", "HeadProjections"]


class HeadProjections(NamedTuple):
    """An attention layer's projections: q, k, v (output rows grouped by head) and o (input columns by head)."""

    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module


class HeadAttention(nn.Module):
    """Base of every attention module whose heads may be staged. Its forward is, for ``x: [B, S, D]``::

        q, k, v = (p(x).view(B, S, -1, head_dim) for p in projections()[:3])
        q, k = prepare_qk(q, k, rope)
        out = inner_attention(q, k, v, attention_mask, **attention_kwargs)  # [B, S, Hq, Dh]
        return projections().o(out.reshape(B, S, -1))

    A subclass sets ``head_dim`` (int), ``inner_attention`` (a backend module) and
    ``attention_kwargs`` (dict) in its ``__init__`` and implements the two methods below.
    """

    head_dim: int
    inner_attention: nn.Module
    attention_kwargs: dict

    def projections(self) -> HeadProjections:
        raise NotImplementedError(f"{type(self).__name__} derives from HeadAttention but has no projections()")

    def prepare_qk(self, q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[B, S, Hq, Dh]`` and k ``[B, S, Hkv, Dh]`` as the kernel takes them (norms, RoPE)."""
        raise NotImplementedError(f"{type(self).__name__} derives from HeadAttention but has no prepare_qk()")
