"""Packed documents as one lower-right causal call per document segment, behind one custom op.

Used where a backend has no mask that scales (sdpa above ``DENSE_MASK_MAX_ELEMENTS``; cp's
segments on sdpa and flash_attn): queries at global indices ``q_index`` (runs of consecutive
indices: the whole sequence under Ulysses, the two load-balanced chunks under cp) against the
keys of the full sequence in order. Each document segment (``masks.segments``) is one
``causal_lower_right`` call of the backend -- on CUDA the unmasked kernels.

Why a custom op: the loop over documents depends on the data. Traced by ``torch.compile`` it
would be unrolled into the graph and retraced for every new batch of documents; as an opaque
op the compiled block stays one graph (``titan_ulysses::attention_per_document`` is in the
selective-AC save list). Its backward recomputes the segments' forward with autograd and
differentiates it (another op, so that AOTAutograd does not trace the loop either): an extra
attention forward in backward, in exchange for keeping only q, k and v.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch._dynamo
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from titan_ulysses.ops.attention.masks import row_spans, segments


# A custom op's implementation runs with autograd's dispatch keys excluded, so autograd records
# nothing there even under enable_grad; the backward op restores the dispatch state of import
# time (no op running) around its recompute. A private guard: if it goes, the backward fails loudly.
_DISPATCH_TLS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


LOWER_RIGHT: dict[str, Callable[[str], nn.Module]] = {}
"""Backend name -> its ``build(sdpa_backends)``, whose module has ``causal_lower_right``: filled by
``registry.py`` from its table (the registry imports this file; this file never imports the registry)."""


@functools.lru_cache(maxsize=None)
def _module(backend: str, sdpa_backends: str):
    return LOWER_RIGHT[backend](sdpa_backends)


_DECODED = WeakIdKeyDictionary()
"""A host tensor the op takes (:func:`host_rows`) -> its rows as Python tuples, kept where it is made (eager, once
per mask): the op reads nothing on every layer. One made elsewhere (in a compiled graph) is read once, on the host."""


def host_rows(rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """``[N, 3]`` int64 on the host of ``rows`` -- document spans ``(row, start, end)`` or query runs ``(first local
    row, global start, global end)`` -- the op's metadata: a host tensor, so that a compiled block stays one
    graph whatever the documents, decoded here once."""
    handle = torch.tensor(rows, dtype=torch.long).reshape(len(rows), 3)  # [N, 3]
    torch._dynamo.maybe_mark_dynamic(handle, 0)  # N changes with the documents: one graph for any
    _DECODED[handle] = [tuple(r) for r in rows]
    return handle


def spans_rows(spans: list[list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """``masks.row_spans``' per-row spans as ``(row, start, end)`` rows."""
    return [(r, a, e) for r, row in enumerate(spans) for a, e in row]


def query_runs(q_index: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive global indices: (first local row, global start, global end)."""
    runs, a = [], 0
    for j in range(1, len(q_index) + 1):
        if j == len(q_index) or q_index[j] != q_index[j - 1] + 1:
            runs.append((a, q_index[a], q_index[j - 1] + 1))
            a = j
    return runs


def _decoded(handle: torch.Tensor) -> list[tuple[int, int, int]]:
    if handle not in _DECODED:  # made inside a compiled graph: a read of a small host tensor
        _DECODED[handle] = [tuple(r) for r in handle.tolist()]
    return _DECODED[handle]


def _row_spans(document_ids: torch.Tensor, spans: torch.Tensor | None) -> list[list[tuple[int, int]]]:
    if spans is None:  # a mask built from device ids alone (no host spans): read them here
        return row_spans(document_ids)
    out = [[] for _ in range(document_ids.shape[0])]
    for r, a, e in _decoded(spans):
        out[r].append((a, e))
    return out


def _attend(q, k, v, document_ids, spans, runs, scale, window, softcap, backend, sdpa_backends):
    lower_right = _module(backend, sdpa_backends).causal_lower_right
    kw = dict(scale=None if scale <= 0 else scale, window=window, softcap=softcap)
    runs = _decoded(runs)
    rows = []
    for r, spans in enumerate(_row_spans(document_ids, spans)):
        outs = []
        for first, start, end in runs:
            for qa, qb, ks in segments(spans, start, end, window):
                rows_q = slice(first + qa - start, first + qb - start)
                outs.append(lower_right(q[r:r + 1, rows_q], k[r:r + 1, ks:qb], v[r:r + 1, ks:qb], **kw))
        rows.append(torch.cat(outs, dim=1))  # [1, Lq, Hq, D]
    return torch.cat(rows, dim=0).contiguous()


@torch.library.custom_op("titan_ulysses::attention_per_document", mutates_args=())
def attention_per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
                           spans: torch.Tensor | None, runs: torch.Tensor, scale: float, window: int, softcap: float,
                           backend: str, sdpa_backends: str) -> torch.Tensor:
    """``q: [B, Lq, Hq, D]`` at the global indices of ``runs`` (``[R, 3]`` on the host, :func:`host_rows` of
    :func:`query_runs`); ``k, v: [B, S, Hkv, D]`` the whole sequence; the documents as ``spans`` (``[N, 3]`` on the
    host, the mask's ``spans_rows``), or None: read from ``document_ids [B, S]``; ``scale <= 0``: ``1/sqrt(D)``.
    -> ``[B, Lq, Hq, D]``."""
    return _attend(q, k, v, document_ids, spans, runs, scale, window, softcap, backend, sdpa_backends)


@attention_per_document.register_fake
def _(q, k, v, document_ids, spans, runs, scale, window, softcap, backend, sdpa_backends):
    return q.new_empty(q.shape)


@torch.library.custom_op("titan_ulysses::attention_per_document_backward", mutates_args=())
def attention_per_document_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    document_ids: torch.Tensor, spans: torch.Tensor | None, runs: torch.Tensor,
                                    scale: float, window: int, softcap: float, backend: str,
                                    sdpa_backends: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad(), torch._C._ForceDispatchKeyGuard(*_DISPATCH_TLS):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = _attend(*leaves, document_ids, spans, runs, scale, window, softcap, backend, sdpa_backends)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)  # keys past every query: unused
    return tuple((torch.zeros_like(t) if g is None else g).contiguous() for g, t in zip(grads, (q, k, v)))


@attention_per_document_backward.register_fake
def _(grad, q, k, v, document_ids, spans, runs, scale, window, softcap, backend, sdpa_backends):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, document_ids, spans, runs, *rest = inputs
    ctx.save_for_backward(q, k, v, document_ids, spans, runs)
    ctx.rest = rest


def _backward(ctx, grad):
    q, k, v, document_ids, spans, runs = ctx.saved_tensors
    dq, dk, dv = attention_per_document_backward(grad.contiguous(), q, k, v, document_ids, spans, runs, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None, None


attention_per_document.register_autograd(_backward, setup_context=_setup_context)
