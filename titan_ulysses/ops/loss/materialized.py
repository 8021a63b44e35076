"""All logits at once (``loss_chunk_size 0`` before 2026-11-28): ``F.linear`` then ``F.cross_entropy``.

Fast at short lengths, but it keeps the ``[N, V]`` logits, their fp32 upcast and log-softmax
(128K tokens x 256K vocabulary in fp32 is 128 GiB): a reference and an A/B point, not a default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ulysses.ops.loss.common import cross_entropy_sum, softcapped


def materialized_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                          chunk_size: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Summed loss of ``hidden: [N, D]`` through ``weight: [V, D]`` against ``labels: [N]`` (``chunk_size`` unused)."""
    logits = softcapped(F.linear(hidden, weight), softcap)  # [N, V]
    return cross_entropy_sum(logits[None], labels[None], ignore_index)
