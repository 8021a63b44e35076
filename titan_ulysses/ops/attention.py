"""Local attention backends: the swap point inside every attention layer.

Each backend is a module ``forward(q, k, v, attention_mask=None, scale=None) -> out`` over
``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]`` (Hq a multiple of Hkv), returning
``[B, S, Hq, D]``. Attention is causal; ``attention_mask`` (built once per step by
:func:`build_attention_mask` from document ids of the full sequence) adds document
masking for packed sequences. ``None`` means plain causal attention. ``scale`` is the
softmax scale (``None``: ``1/sqrt(D)``).

* ``sdpa``: ``F.scaled_dot_product_attention``; on CUDA it dispatches to FlashAttention
  or cuDNN kernels, in the order :func:`sdpa_priority` gives (``model.sdpa_backends``).
  Document masking materialises a dense [B, 1, S, S] mask, so use it
  only at short lengths; ``flex`` is the long-context path for packed documents.
  Its ``causal_lower_right(q, k, v)`` (queries shorter than the keys, the causal diagonal
  bottom-right) is what context parallelism calls per chunk; a backend that cp should run
  on needs that method too.
* ``flex``: FlexAttention with a BlockMask (causal, or causal within documents).
* ``flash_attn``: the flash-attn package (CUDA only, optional extra); document masking
  through its varlen kernel with cumulative sequence lengths.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("sdpa", "flex", "flash_attn")

# SDPA's kernels by the names ``model.sdpa_backends`` takes
SDPA_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}


def _pytorch_order() -> tuple[str, ...]:
    """The names above in the order this build of PyTorch tries them by default (a CPU build:
    flash, efficient, math, cudnn)."""
    try:
        default = [SDPBackend(i) for i in torch._C._get_sdp_priority_order()]
    except (AttributeError, TypeError, ValueError):  # a private call: keep the documented order if it goes
        return tuple(SDPA_KERNELS)
    by_kernel = {kernel: name for name, kernel in SDPA_KERNELS.items()}
    named = [by_kernel[k] for k in default if k in by_kernel]
    return (*named, *(n for n in SDPA_KERNELS if n not in named))


def parse_sdpa_backends(setting: str) -> tuple[str, ...]:
    """``"auto"`` -> ``()``; ``"cudnn,flash"`` -> ``("cudnn", "flash")``; anything else raises
    a ValueError that names the setting."""
    if setting == "auto":
        return ()
    names = tuple(n.strip() for n in setting.split(","))
    wrong = [n for n in names if n not in SDPA_KERNELS]
    if wrong or len(set(names)) != len(names):
        what = f"{wrong[0]!r} is not a kernel" if wrong else "a kernel is named twice"
        raise ValueError(f"model.sdpa_backends {setting!r}: {what}; use 'auto' or a comma-separated priority "
                         f"order of {', '.join(SDPA_KERNELS)} (e.g. 'cudnn,flash')")
    return names


def sdpa_priority(setting: str, masked: bool = False) -> tuple[str, ...]:
    """The order in which SDPA tries its kernels for ``model.sdpa_backends`` on this machine, for
    plain causal calls or, with ``masked``, calls with a dense (document) mask.

    ``()`` keeps PyTorch's (:func:`_pytorch_order`). ``"auto"`` on CUDA:

    * causal: cuDNN first on Hopper (compute capability 9.x), where its causal fwd+bwd ran at
      1.8x FlashAttention's rate on an H200 at 32K-128K tokens (``docs/benchmarks.md``; others
      measured it slower on Ampere and Blackwell); PyTorch's order elsewhere.
    * masked: the memory-efficient kernel first (FlashAttention takes no mask), not cuDNN,
      whose backward with an explicit mask returns NaN in dq for some lengths from torch 2.11
      on (pytorch/pytorch#196678); with is_causal and no mask it is clean.

    A list applies to both and is a preference, not a restriction: the kernels it leaves out
    follow in PyTorch's order, so that a shape the named kernels cannot take still runs.
    """
    names = parse_sdpa_backends(setting)
    if setting == "auto" and torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] == 9
        names = ("efficient",) if masked else (("cudnn",) if hopper else ())
    return (*names, *(n for n in _pytorch_order() if n not in names)) if names else ()


def _cuda_needs_kv_expanded(q, k, dense_mask: bool) -> bool:
    """On CUDA only the flash kernel takes GQA (enable_gqa) natively; with a mask or in fp32 the
    memory-efficient / cuDNN kernels need as many kv heads as q heads, and without them SDPA
    falls back to the math kernel, which materialises [B, H, S, S] scores (seen on an H200).
    CPU kernels take enable_gqa as they are."""
    return q.shape[2] != k.shape[2] and q.is_cuda and (dense_mask or q.dtype not in (torch.bfloat16, torch.float16))


def _expand_kv(q, k, v):
    """``k, v: [B, S, Hkv, D] -> [B, S, Hq, D]`` (kv head j serves q heads j*rep ... j*rep+rep-1)."""
    return (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))


def _flash_lower_right(q) -> bool:
    """Whether the lower-right causal path below runs PyTorch's flash kernel for ``q: [B, H, L, D]``.

    Decided from dtype, device and head size alone (the flash kernel's limits, on the Ampere
    or newer GPUs this project targets): ``torch.backends.cuda.can_use_flash_attention`` needs
    an ``SDPAParams``, which dynamo cannot build under ``fullgraph=True``.
    """
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


class SDPAAttention(nn.Module):
    def __init__(self, sdpa_backends: str = "auto"):
        super().__init__()
        # kernel orders for calls without and with a mask, resolved for this machine; empty: PyTorch's
        self.orders = {m: [SDPA_KERNELS[n] for n in sdpa_priority(sdpa_backends, m)] for m in (False, True)}

    def _kernels(self, masked: bool):
        order = self.orders[masked]
        return sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext()

    def forward(self, q, k, v, attention_mask=None, scale=None):
        gqa = q.shape[2] != k.shape[2]
        if _cuda_needs_kv_expanded(q, k, attention_mask is not None):
            k, v = _expand_kv(q, k, v)
            gqa = False
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        with self._kernels(attention_mask is not None):
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=attention_mask, scale=scale, enable_gqa=gqa
                )
        return out.transpose(1, 2)  # [B, S, H, D]

    def causal_lower_right(self, q, k, v, scale=None):
        """Causal attention of the last ``Lq`` tokens of an ``Lk``-token prefix, the diagonal aligned bottom-right.

        ``q: [B, Lq, Hq, D]``, ``k, v: [B, Lk, Hkv, D]`` with ``Lq <= Lk``: query ``i`` sees keys
        ``0 .. i + Lk - Lq``. Context parallelism calls it for each chunk of a rank's queries
        against the gathered keys up to the chunk's end (``distributed/context_parallel.py``).

        Plain tensors and ints only, so that selective activation checkpointing and
        ``torch.compile(fullgraph=True)`` take it (``torch.nn.attention.bias.causal_lower_right``
        does neither: its ``CausalBias`` is a tensor subclass built through the legacy
        constructor, which dynamo refuses and which fails under a dispatch mode -- and it
        allocates an uninitialised ``[2, Lq, Lk]`` fp32 tensor on every call).

        * CUDA, bf16/fp16, head size a multiple of 8 up to 256: PyTorch's flash kernel, no mask. Its
          ``is_causal`` aligns the diagonal bottom-right when ``Lq != Lk`` (FlashAttention 2's
          convention); sdpa's front end refuses flash for non-square causal attention, so the
          aten op is called directly, as ``CausalBias`` does. It takes GQA as is.
        * elsewhere (CPU, fp32): sdpa with an explicit ``[Lq, Lk]`` boolean mask built from the
          two lengths -- what ``CausalBias`` materialises there too, so the numbers are the same.
        """
        lq, lk = q.shape[1], k.shape[1]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        if _flash_lower_right(qt):
            out = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)[0]
            return out.transpose(1, 2)  # [B, Lq, Hq, D]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)  # [Lq, Lk]
        return self.forward(q, k, v, mask, scale)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


_compiled_flex = None


def _flex_kernel(on_cuda: bool):
    """Eager flex_attention materialises the full score matrix; on CUDA use the compiled
    (fused) kernel unless we are already inside a compiled region."""
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if not on_cuda or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


class FlexAttention(nn.Module):
    def forward(self, q, k, v, attention_mask=None, scale=None):
        from torch.nn.attention.flex_attention import create_block_mask

        b, s = q.shape[:2]
        if attention_mask is None:
            attention_mask = create_block_mask(_causal, None, None, s, s, device=q.device)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        out = _flex_kernel(q.is_cuda)(
            q, k, v, block_mask=attention_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2)


def _import_flash_attn():
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "attn_backend 'flash_attn' needs the flash-attn package, which is not installed; "
            "install it with `pip install 'titan_ulysses[flash]'` on a CUDA machine, "
            "or use attn_backend 'sdpa' (FlashAttention kernels through PyTorch) or 'flex'"
        ) from e
    return flash_attn


class FlashAttnAttention(nn.Module):
    def __init__(self):
        super().__init__()
        _import_flash_attn()

    def forward(self, q, k, v, attention_mask=None, scale=None):
        flash_attn = _import_flash_attn()
        if attention_mask is None:
            return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)  # [B, S, H, D]
        cu_seqlens, max_seqlen = attention_mask
        b, s = q.shape[:2]
        flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]  # batch rows concatenated
        out = flash_attn.flash_attn_varlen_func(
            *flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=True
        )
        return out.reshape(b, s, *out.shape[1:])


def build_attention(backend: str, sdpa_backends: str = "auto") -> nn.Module:
    if backend == "sdpa":
        return SDPAAttention(sdpa_backends)
    if backend == "flex":
        return FlexAttention()
    if backend == "flash_attn":
        return FlashAttnAttention()
    raise ValueError(f"attn_backend {backend!r} is not one of {list(BACKENDS)}")


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


def build_attention_mask(backend: str, document_ids: torch.Tensor | None):
    """The per-step mask object of ``backend`` for document ids ``[B, S]`` of the full sequence.

    Returns ``None`` (plain causal) when ``document_ids`` is None. Build it once per step,
    outside the model: every layer reuses it, and under Ulysses it covers the full
    sequence that attention sees after the exchange.
    """
    if document_ids is None:
        return None
    if backend == "sdpa":
        s = document_ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
        same_doc = document_ids[:, :, None] == document_ids[:, None, :]
        return (same_doc & causal)[:, None]  # [B, 1, S, S]
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        b, s = document_ids.shape

        def doc_causal(b_idx, h, q_idx, kv_idx):
            same = document_ids[b_idx, q_idx] == document_ids[b_idx, kv_idx]
            return same & (q_idx >= kv_idx)

        return create_block_mask(doc_causal, b, None, s, s, device=document_ids.device)
    if backend == "flash_attn":
        return cu_seqlens_from_document_ids(document_ids)
    raise ValueError(f"attn_backend {backend!r} is not one of {list(BACKENDS)}")
