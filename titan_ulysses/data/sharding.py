"""Split one batch across the ranks of a Ulysses (sp) group.

Every rank of an sp group loads the same sample ``[B, S]`` with labels already shifted
on the full sequence, and slices it on the host: only its own share goes to the device.
``S`` is padded at the end up to a multiple of the SP degree
(padding labels are ignored, and causal attention keeps padding out of every real
token's view), then rank r keeps tokens ``[r*S/P, (r+1)*S/P)`` together with their global
positions for RoPE. Document ids stay full-length: attention sees the whole sequence.

With context parallelism (degree C, outside sp) the sequence is split over C x P ranks.
For causal load balance it is padded to a multiple of 2 x C x P and cut into 2C chunks;
cp rank r holds chunks r and 2C-1-r (a head and a tail chunk, :func:`load_balanced_order`),
and splits those 2 chunks contiguously over its P sp ranks. Tokens, labels and positions
follow the same permutation (the loss is a sum over tokens, so only consistency matters);
positions stay the true global ones, and :attr:`SPBatch.index` says where each token sits
in the padded sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_ulysses.ops.attention.masks import row_spans
from titan_ulysses.ops.loss import IGNORE_INDEX


def seq_multiple(sp: int, cp: int = 1) -> int:
    """What a (padded) sequence length must divide by: sp, or 2 x cp x sp with context parallelism."""
    return sp if cp == 1 else 2 * cp * sp


def padded_length(seq_len: int, sp: int, cp: int = 1) -> int:
    m = seq_multiple(sp, cp)
    return -(-seq_len // m) * m


def check_seq_len(seq_len: int, sp: int, cp: int = 1) -> None:
    """Refuse a sequence length that the degrees do not divide, naming the nearest valid ones."""
    m = seq_multiple(sp, cp)
    if seq_len % m:
        lower, upper = seq_len // m * m, padded_length(seq_len, sp, cp)
        nearest = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        if cp == 1:
            raise ValueError(
                f"seq_len {seq_len} is not divisible by ulysses_degree {sp}; use seq_len {nearest}, "
                f"or let the batch be padded to a multiple of ulysses_degree"
            )
        raise ValueError(
            f"seq_len {seq_len} is not divisible by 2 x context_parallel_degree x ulysses_degree = "
            f"2 x {cp} x {sp} = {m} (each context-parallel rank holds a head and a tail chunk); "
            f"use seq_len {nearest}"
        )


def load_balanced_order(s: int, cp: int, device=None) -> torch.Tensor:
    """``[s]`` token indices in the order the cp ranks hold them (``s`` a multiple of 2 x cp).

    The sequence is cut into 2cp chunks; rank r holds chunks r and 2cp-1-r, so under causal
    attention every rank has as many (query, key) pairs to score. cp = 1 is the identity.
    """
    chunks = torch.arange(s, device=device).view(2 * cp, -1) if cp > 1 else None
    if chunks is None:
        return torch.arange(s, device=device)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def rank_token_index(s_pad: int, sp_rank: int, sp: int, cp_rank: int = 0, cp: int = 1, device=None) -> torch.Tensor:
    """``[s_pad / (cp*sp)]`` indices into the padded sequence of the tokens one (cp, sp) rank holds."""
    return load_balanced_order(s_pad, cp, device).view(cp, sp, -1)[cp_rank, sp_rank]


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
    index: torch.Tensor | None = None
    """[S_pad/P] where this rank's tokens sit in the padded sequence (with cp: load-balanced order)."""
    spans: list[list[tuple[int, int]]] | None = None
    """Per row, the ``(start, end)`` of each document of ``document_ids`` (``ops/attention/masks.row_spans``), read
    on the host where the loader's batch is (:func:`shard_host_batch`), so that no mask reads the device; stays on
    the host. None: not read (one document, or a batch sharded elsewhere)."""


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
    cp_rank: int = 0,
    cp: int = 1,
) -> SPBatch:
    """Shard a full ``[B, S]`` batch for rank ``sp_rank`` of ``sp`` (and ``cp_rank`` of ``cp``).

    With ``pad=False`` a length that the degrees do not divide is refused instead of padded.
    """
    b, s = tokens.shape
    if labels.shape != tokens.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and tokens {tuple(tokens.shape)} differ in shape")
    if not pad:
        check_seq_len(s, sp, cp)
    if positions is None:
        positions = torch.arange(s, device=tokens.device).expand(b, s)
    s_pad = padded_length(s, sp, cp)
    # padding continues the positions past the end; it is never attended to by real tokens
    tail = torch.arange(s, s_pad, device=tokens.device).expand(b, s_pad - s)
    positions = torch.cat([positions, tail], dim=1)
    if document_ids is not None and s_pad > s:
        document_ids = F.pad(document_ids, (0, s_pad - s), value=-1)
    index = rank_token_index(s_pad, sp_rank, sp, cp_rank, cp, device=tokens.device)
    if cp > 1:
        def take(x, pad_value):
            return F.pad(x, (0, s_pad - s), value=pad_value)[:, index]

        return SPBatch(
            tokens=take(tokens, pad_token), labels=take(labels, ignore_index),
            positions=positions[:, index], document_ids=document_ids, index=index,
        )
    return SPBatch(
        tokens=shard_for_sp(tokens, sp_rank, sp, pad_token),
        labels=shard_for_sp(labels, sp_rank, sp, ignore_index),
        positions=positions.chunk(sp, dim=1)[sp_rank],
        document_ids=document_ids,
        index=index,
    )


def shard_host_batch(batch: dict, sp_rank: int, sp: int, packed: bool, pad_token: int = 0, cp_rank: int = 0,
                     cp: int = 1, pin: bool = False) -> SPBatch:
    """This rank's share of one loader batch (dict of ``[B, S]`` host tensors), still on the host.

    Positions are those of the batch, row by row (they restart per document when rows are
    packed); document ids are kept only when ``packed``, so that attention masks per document.
    ``pin``: each field is a contiguous page-locked copy, for a ``non_blocking`` upload."""
    b = shard_batch(batch["input"], batch["labels"], sp_rank, sp, positions=batch.get("positions"),
                    document_ids=batch["document_ids"] if packed else None, pad_token=pad_token,
                    cp_rank=cp_rank, cp=cp)
    if b.document_ids is not None:  # host ids: their spans cost no read of the device
        b = dataclasses.replace(b, spans=row_spans(b.document_ids))
    return _each(b, lambda x: torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x)) if pin else b


def to_device(b: SPBatch, device, non_blocking: bool = False) -> SPBatch:
    """``b`` on ``device``: the copies move this rank's slice only (``non_blocking`` from pinned memory)."""
    return _each(b, lambda x: x.to(device, non_blocking=non_blocking))


def _each(b: SPBatch, fn) -> SPBatch:
    return SPBatch(*(None if x is None else fn(x) for x in (b.tokens, b.labels, b.positions, b.document_ids,
                                                               b.index)), spans=b.spans)


def shard_loader_batch(batch: dict, sp_rank: int, sp: int, device, packed: bool, pad_token: int = 0,
                       cp_rank: int = 0, cp: int = 1) -> SPBatch:
    """Shard one loader batch for rank ``sp_rank`` of ``sp`` (and ``cp_rank`` of ``cp``) on the host,
    then copy this rank's slice to ``device`` (:func:`shard_host_batch`)."""
    return to_device(shard_host_batch(batch, sp_rank, sp, packed, pad_token, cp_rank, cp), device)
