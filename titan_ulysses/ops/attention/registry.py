"""The attention-backend registry: what each backend can do, its module, its mask, its AC ops.

Adding a backend is one file (its module) and one :class:`Backend` entry in ``BACKENDS``. The
trainer, config validation (:func:`check_attention_settings`), context parallelism, selective
activation checkpointing (:func:`save_ops`) and the memory estimate ask this table, never the
backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from titan_ulysses.ops.attention import per_document  # registers titan_ulysses::attention_per_document
from titan_ulysses.ops.attention.masks import (DENSE_MASK_MAX_ELEMENTS, DocumentMask, cu_seqlens_from_document_ids,
                                               cu_seqlens_from_spans)
from titan_ulysses.ops.attention.sdpa import SDPAAttention, parse_sdpa_backends


@dataclass(frozen=True)
class Backend:
    name: str
    build: Callable[[str], nn.Module]
    """``build(sdpa_backends)`` -> the local attention module."""
    build_mask: Callable[[torch.Tensor, list | None], DocumentMask]
    """Document ids ``[B, S]`` of the full padded sequence (and their spans, read on the host, or None) -> the
    per-step mask object."""
    cpu_backward: bool
    """Trains on CPU (forward and backward)."""
    cuda_only: bool
    """Needs CUDA even for the forward."""
    native_gqa: bool
    """Takes fewer kv heads than q heads without copying them (in the fused kernels)."""
    documents: str
    """How packed documents are masked (never an [S, S] tensor at long lengths)."""
    window: bool
    """Sliding windows (``window=W``)."""
    softcap: str
    """Score capping (``softcap``): "fused", "unfused" (explicit scores, in query blocks)."""
    sinks: str
    """Attention sinks (``sinks``, a logit per head in the softmax's denominator: gpt-oss): "unfused"
    (explicit scores, in query blocks) or "" (not implemented)."""
    cp: bool
    """Runs under context parallelism (lower-right causal calls, documents at global positions)."""
    save_ops: tuple[str, ...]
    """Ops whose outputs selective activation checkpointing keeps ("namespace.op")."""


def _sdpa(sdpa_backends: str) -> nn.Module:
    return SDPAAttention(sdpa_backends)


def _flex(sdpa_backends: str) -> nn.Module:
    from titan_ulysses.ops.attention.flex import FlexAttention

    return FlexAttention()


def _flash_attn(sdpa_backends: str) -> nn.Module:
    from titan_ulysses.ops.attention.flash_attn import FlashAttnAttention

    return FlashAttnAttention()


def _sdpa_mask(document_ids: torch.Tensor, spans: list | None) -> DocumentMask:
    """A dense [B, 1, S, S] mask only at small sizes (the compiled tests' path); above, per-document calls."""
    b, s = document_ids.shape
    dense = None
    if b * s * s <= DENSE_MASK_MAX_ELEMENTS:
        causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
        dense = ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]
    return DocumentMask(document_ids, "sdpa", dense=dense, query_runs=per_document.host_rows([(0, 0, s)]))


def _flex_mask(document_ids: torch.Tensor, spans: list | None) -> DocumentMask:
    return DocumentMask(document_ids, "flex")  # block masks per window, made on first use


def _flash_attn_mask(document_ids: torch.Tensor, spans: list | None) -> DocumentMask:
    """The varlen offsets: from the spans on the host when given (no read of the device), else from the ids."""
    cu = (cu_seqlens_from_document_ids(document_ids) if spans is None else
          cu_seqlens_from_spans(spans, document_ids.shape[1], document_ids.device))
    return DocumentMask(document_ids, "flash_attn", cu_seqlens=cu)


BACKENDS: dict[str, Backend] = {
    "sdpa": Backend(
        "sdpa", _sdpa, _sdpa_mask, cpu_backward=True, cuda_only=False, native_gqa=True,
        documents="a dense mask up to 16M elements, per-document causal calls above",
        window=True, softcap="unfused", sinks="unfused", cp=True,
        save_ops=("aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                  "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                  "titan_ulysses.attention_per_document"),
    ),
    "flex": Backend(
        "flex", _flex, _flex_mask, cpu_backward=False, cuda_only=False, native_gqa=True,
        documents="a BlockMask from per-block document and position ranges",
        window=True, softcap="fused", sinks="", cp=True, save_ops=("higher_order.flex_attention",),
    ),
    "flash_attn": Backend(
        "flash_attn", _flash_attn, _flash_attn_mask, cpu_backward=False, cuda_only=True, native_gqa=True,
        documents="varlen kernel with cumulative document lengths", window=True, softcap="fused", sinks="", cp=True,
        save_ops=("flash_attn._flash_attn_forward", "flash_attn._flash_attn_varlen_forward",
                  "titan_ulysses.attention_per_document"),
    ),
}

per_document.LOWER_RIGHT.update({name: backend.build for name, backend in BACKENDS.items()})


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"model.attn_backend {name!r} is not one of {list(BACKENDS)}")
    return BACKENDS[name]


def build_attention(backend: str, sdpa_backends: str = "auto") -> nn.Module:
    return get_backend(backend).build(sdpa_backends)


def build_attention_mask(backend: str, document_ids: torch.Tensor | None, spans: list | None = None):
    """The per-step mask object of ``backend`` for document ids ``[B, S]`` of the full sequence.

    Returns ``None`` (plain causal) when ``document_ids`` is None. Build it once per step,
    outside the model: every layer reuses it, and under Ulysses it covers the full
    sequence that attention sees after the exchange. ``spans``: the ids' ``masks.row_spans``, read on the host
    from the loader's batch (``SPBatch.spans``): with them no mask reads the device (flash_attn's offsets, the
    per-document calls of sdpa above the dense size and of cp); without, those read the ids.
    """
    backend_ = get_backend(backend)
    if document_ids is None:
        return None
    mask = backend_.build_mask(document_ids, spans)
    if spans is not None:
        mask.spans_rows = per_document.host_rows(per_document.spans_rows(spans))
    return mask


def save_ops() -> set:
    """Every registered backend's selective-AC ops that this PyTorch (and its extensions) has."""
    ops = set()
    for backend in BACKENDS.values():
        for name in backend.save_ops:
            namespace, op = name.split(".")
            try:
                packet = getattr(getattr(torch.ops, namespace), op)
            except (AttributeError, RuntimeError):  # an op of a build or package that is not here
                continue
            ops.add(getattr(packet, "default", packet))
    return ops


def check_attention_settings(attn_backend: str, sdpa_backends: str, cp: int, device_type: str | None = None) -> None:
    """Refuse what a backend cannot do, in one line naming the alternative (before any process group)."""
    backend = get_backend(attn_backend)
    parse_sdpa_backends(sdpa_backends)
    if cp > 1 and not backend.cp:
        raise ValueError(f"parallelism.context_parallel_degree {cp} is not implemented for model.attn_backend "
                         f"{attn_backend!r}; use one of {[b.name for b in BACKENDS.values() if b.cp]}")
    if device_type == "cpu" and not backend.cpu_backward:
        why = "flash-attn is CUDA-only" if backend.cuda_only else "it has no CPU backward in this PyTorch"
        raise ValueError(f"model.attn_backend {attn_backend!r} cannot train on CPU ({why}); "
                         f"use one of {[b.name for b in BACKENDS.values() if b.cpu_backward]} on CPU")
