"""Liger-Kernel's fused linear cross-entropy (``pip install 'titan-ulysses[liger]'``; CUDA, Triton).

Gradients in forward like ``fused``, with ``accum_dtype=float32`` so ``dW`` accumulates in fp32 as
ours does. Its forward reads a count to the host (``.item()``); ours does not. For A/B and as a peer.
"""

from __future__ import annotations

import torch


def liger_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   chunk_size: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Summed loss of ``hidden: [N, D]`` through ``weight: [V, D]`` against ``labels: [N]`` (liger's own chunks)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    loss = liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, reduction="sum",
                                            softcap=softcap, accum_dtype=torch.float32)
    loss = loss[0] if isinstance(loss, tuple) else loss  # (loss, z_loss) in some versions
    return getattr(loss, "loss", loss).float()  # CrossEntropyOutput in newer ones
