"""Apple's Cut Cross-Entropy (``pip install 'titan-ulysses[cce]'``; CUDA, Triton).

Keeps only the target logit and the log-sum-exp, recomputes logits blockwise in backward and
skips gradient entries below bf16's resolution. For A/B against ``fused``.
"""

from __future__ import annotations

import torch


def cce_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                 chunk_size: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Summed loss of ``hidden: [N, D]`` through ``weight: [V, D]`` against ``labels: [N]`` (its own blocks)."""
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, softcap=softcap,
                                reduction="sum").float()
