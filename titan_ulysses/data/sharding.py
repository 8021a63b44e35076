"""Split one batch across the ranks of a Ulysses (sp) group.

Every rank of an sp group loads the same sample ``[B, S]`` with labels already shifted
on the full sequence. ``S`` is padded at the end up to a multiple of the SP degree
(padding labels are ignored, and causal attention keeps padding out of every real
token's view), then rank r keeps tokens ``[r*S/P, (r+1)*S/P)`` together with their global
positions for RoPE. Document ids stay full-length: attention sees the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_ulysses.ops.loss import IGNORE_INDEX


def padded_length(seq_len: int, sp: int) -> int:
    return -(-seq_len // sp) * sp


def check_seq_len(seq_len: int, sp: int) -> None:
    """Refuse a sequence length that the SP degree does not divide, naming the nearest valid ones."""
    if seq_len % sp:
        lower, upper = seq_len // sp * sp, padded_length(seq_len, sp)
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise ValueError(
            f"seq_len {seq_len} is not divisible by ulysses_degree {sp}; use seq_len {nearest}, "
            f"or let the batch be padded to a multiple of ulysses_degree"
        )


def shard_for_sp(x: torch.Tensor, sp_rank: int, sp: int, pad_value, dim: int = 1) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to a multiple of ``sp`` with ``pad_value`` and return slice ``sp_rank``."""
    s = x.shape[dim]
    pad = padded_length(s, sp) - s
    if pad:
        widths = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, pad]
        x = F.pad(x, widths, value=pad_value)
    return x.chunk(sp, dim=dim)[sp_rank]


@dataclass
class SPBatch:
    tokens: torch.Tensor
    """[B, S_pad/P] this rank's tokens."""
    labels: torch.Tensor
    """[B, S_pad/P] their labels (IGNORE_INDEX on padding)."""
    positions: torch.Tensor
    """[B, S_pad/P] global positions of the tokens (within their document when packed)."""
    document_ids: torch.Tensor | None
    """[B, S_pad] document ids of the full (padded) sequence, -1 on padding; None: one document."""


def shard_batch(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    sp_rank: int,
    sp: int,
    positions: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    pad_token: int = 0,
    ignore_index: int = IGNORE_INDEX,
    pad: bool = True,
) -> SPBatch:
    """Shard a full ``[B, S]`` batch for rank ``sp_rank`` of ``sp``.

    With ``pad=False`` a length that ``sp`` does not divide is refused instead of padded.
    """
    b, s = tokens.shape
    if labels.shape != tokens.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and tokens {tuple(tokens.shape)} differ in shape")
    if not pad:
        check_seq_len(s, sp)
    if positions is None:
        positions = torch.arange(s, device=tokens.device).expand(b, s)
    s_pad = padded_length(s, sp)
    # padding continues the positions past the end; it is never attended to by real tokens
    tail = torch.arange(s, s_pad, device=tokens.device).expand(b, s_pad - s)
    positions = torch.cat([positions, tail], dim=1)
    if document_ids is not None and s_pad > s:
        document_ids = F.pad(document_ids, (0, s_pad - s), value=-1)
    return SPBatch(
        tokens=shard_for_sp(tokens, sp_rank, sp, pad_token),
        labels=shard_for_sp(labels, sp_rank, sp, ignore_index),
        positions=positions.chunk(sp, dim=1)[sp_rank],
        document_ids=document_ids,
    )


def shard_loader_batch(batch: dict, sp_rank: int, sp: int, device, packed: bool, pad_token: int = 0) -> SPBatch:
    """Shard one loader batch (dict of ``[B, S]`` tensors) for rank ``sp_rank`` of ``sp``.

    Positions are those of the batch, row by row (they restart per document when rows are
    packed); document ids are kept only when ``packed``, so that attention masks per document.
    """
    return shard_batch(
        batch["input"].to(device), batch["labels"].to(device), sp_rank, sp,
        positions=batch["positions"].to(device) if "positions" in batch else None,
        document_ids=batch["document_ids"].to(device) if packed else None,
        pad_token=pad_token,
    )
