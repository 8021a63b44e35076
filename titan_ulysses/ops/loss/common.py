"""What every loss backend shares: the ignore index, the fp32 upcast, the plain summed cross-entropy,
and the automatic chunk size."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

CHUNK_ELEMENTS_MIN, CHUNK_ELEMENTS_MAX = 2**26, 2**28
"""Bounds on one chunk's ``[rows, V]`` logits, in elements (128 MiB .. 512 MiB in bf16)."""


def upcast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype :func:`upcast` gives ``t``, without making the copy (a ``[T, D]`` fp32 transient)."""
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits lose the loss; fp64 stays fp64)."""
    return t.to(upcast_dtype(t))


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of per-token losses of ``logits: [B, S, V]`` against ``labels: [B, S]`` in fp32."""
    return F.cross_entropy(
        upcast(logits.flatten(0, 1)), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )


def softcapped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's final logit softcap, ``softcap * tanh(logits / softcap)`` (None: the logits)."""
    return logits if not softcap else softcap * torch.tanh(logits / softcap)


def auto_chunk_size(tokens: int, vocab: int, dim: int) -> int:
    """Rows per chunk of the output projection + loss when ``model.loss_chunk_size`` is 0.

    One chunk's logits ``[rows, V]`` hold about as many elements as the hidden states ``[T, D]``
    (whose gradient the fused loss keeps anyway), within 2^26 .. 2^28 elements: big enough for
    the matmuls to run at full speed, small enough that the transient never dominates. A power
    of two (tensor-core friendly), at least 16 rows, at most the token count: 4K and 1M tokens
    share one rule. From shapes only (no data-dependent size).
    """
    budget = min(max(tokens * dim, CHUNK_ELEMENTS_MIN), CHUNK_ELEMENTS_MAX)
    rows = 1 << max(4, (max(1, budget // max(vocab, 1))).bit_length() - 1)
    return max(1, min(int(tokens), rows))


def chunk_rows(chunk_size: int, tokens: int, vocab: int, dim: int) -> int:
    """``chunk_size`` when set (an override), else :func:`auto_chunk_size`."""
    return chunk_size if chunk_size > 0 else auto_chunk_size(tokens, vocab, dim)
