"""What every backend's masks are made of: document spans, windows, the per-step mask object.

Visibility (every backend, every layout): query at global index ``i`` sees key ``j`` when
``j <= i`` (causal), ``i - window < j`` when ``window > 0`` (Hugging Face ``sliding_window``)
and both lie in the same document when the sequence is packed.

A packed sequence's documents are contiguous runs of equal ids in each row (padding, id -1,
is one more run). So any query range ``[a, b)`` against the keys it may see splits into
*segments*: per document, the queries of the range that lie in it against the keys from the
document's start (or the window's) up to the last query -- lower-right aligned causal attention,
which every backend runs without an ``[S, S]`` mask. :func:`segments` lists them from host-side
spans (``per_document.py`` runs them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def row_spans(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """``[B, S]`` ids -> per row, the ``(start, end)`` of each run of equal ids (one host sync)."""
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    rows: list[list[int]] = [[] for _ in range(b)]
    for r, c in starts.nonzero().tolist():
        rows[r].append(c)
    return [list(zip(cols, cols[1:] + [s])) for cols in rows]


def segments(spans: list[tuple[int, int]], a: int, b: int, window: int = 0) -> list[tuple[int, int, int]]:
    """The query range ``[a, b)`` of one row cut by documents: ``(q_start, q_end, k_start)`` each,
    keys ``[k_start, q_end)`` (lower-right aligned; the window's start when it cuts the document)."""
    out = []
    for s, e in spans:
        qa, qb = max(a, s), min(b, e)
        if qa >= qb:
            continue
        out.append((qa, qb, max(s, qa - window + 1) if window > 0 else s))
    return out


def visible(q_index: torch.Tensor, k_index: torch.Tensor, window: int = 0) -> torch.Tensor:
    """``[Lq, Lk]`` bool: causal (and windowed) visibility by global indices."""
    diff = q_index[:, None] - k_index[None, :]
    ok = diff >= 0
    if window > 0:
        ok = ok & (diff < window)
    return ok


def lower_right_mask(lq: int, lk: int, window: int, device) -> torch.Tensor:
    """``[Lq, Lk]`` bool of lower-right aligned causal (windowed) attention, from the two lengths."""
    return visible(torch.arange(lk - lq, lk, device=device), torch.arange(lk, device=device), window)


def cu_seqlens_from_spans(spans: list[list[tuple[int, int]]], seq_len: int, device) -> tuple[torch.Tensor, int]:
    """:func:`cu_seqlens_from_document_ids` from the rows' spans, already on the host: no read of the device
    (the offsets are uploaded ``non_blocking`` from pinned memory on CUDA; the longest document is a host int)."""
    starts = [r * seq_len + a for r, row in enumerate(spans) for a, _ in row] + [len(spans) * seq_len]
    cu = torch.tensor(starts, dtype=torch.int32)
    cuda = torch.device(device).type == "cuda"
    cu = cu.pin_memory().to(device, non_blocking=True) if cuda else cu.to(device)
    return cu, max(e - a for row in spans for a, e in row)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document lengths over the flattened batch ``[B*S]`` (int32) and the longest document.

    A document never spans two rows, even where neighbouring rows share an id.
    """
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = starts.flatten().nonzero().flatten()
    end = torch.tensor([b * s], device=document_ids.device)
    cu = torch.cat([start_idx, end]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@dataclass(eq=False)
class DocumentMask:
    """The per-step mask of a packed batch, built once (``build_attention_mask``) and shared by
    every layer: the document ids of the full padded sequence and what the backend derived from
    them (never an ``[S, S]`` tensor above ``DENSE_MASK_MAX_ELEMENTS``)."""

    document_ids: torch.Tensor
    """[B, S] ids of the full (padded) sequence; -1 on padding."""
    backend: str
    """The backend it was built for (a mask of another backend is refused)."""
    dense: torch.Tensor | None = None
    """sdpa at small lengths only: [B, 1, S, S] bool, causal within documents."""
    cu_seqlens: tuple[torch.Tensor, int] | None = None
    """flash_attn: cumulative document lengths over the flattened batch and the longest document."""
    spans_rows: torch.Tensor | None = None
    """``[N, 3]`` (row, start, end) of each run of equal ids (:func:`row_spans`) on the host, from the loader's batch
    (``data/sharding.py``): what the per-document calls cut by, read on no layer; None: a mask built from device
    ids alone (each per-document call reads them)."""
    query_runs: torch.Tensor | None = None
    """sdpa: ``[1, 3]`` on the host, every query of the sequence as one run, for its per-document calls above the
    dense size (``per_document.py``)."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def shape(self):
        return self.document_ids.shape

    def cached(self, key, build):
        """A per-step cache for derived metadata (block masks per window, cp segments)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


DENSE_MASK_MAX_ELEMENTS = 2**24
"""Above B x S x S = 16M elements sdpa's document masking runs per document, not through a dense mask."""
