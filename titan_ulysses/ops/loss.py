"""Token-level cross-entropy, summed, so callers choose the normaliser (the global token count)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of per-token losses of ``logits: [B, S, V]`` against ``labels: [B, S]`` in fp32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )
