"""The ``sdpa`` backend: ``F.scaled_dot_product_attention`` and the order its CUDA kernels are tried in.

On CUDA sdpa dispatches to FlashAttention, cuDNN or memory-efficient kernels, in the order
:func:`sdpa_priority` gives (``model.sdpa_backends``). Every call is causal; what it adds:

* ``window`` (sliding window) and cp's lower-right calls: queries in blocks of ``BLOCK``, each
  against only the keys it may see, with an ``[block, block + window]`` mask built from ints;
* ``softcap``: sdpa has no score hook, so scores are computed explicitly (``_math``), in the
  same query blocks -- exact, unfused (flex and flash_attn fuse it);
* ``sinks`` (gpt-oss: one learned logit per head in every softmax's denominator): the same
  explicit path, a sink column beside each row's scores;
* packed documents: a dense ``[B, 1, S, S]`` mask only while ``B x S x S`` is at most
  ``masks.DENSE_MASK_MAX_ELEMENTS``; above, one causal call per document (``per_document.py``,
  one custom op), each on the unmasked kernels (cuDNN / flash on CUDA) -- no ``[S, S]`` tensor.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from titan_ulysses.ops.attention.masks import DocumentMask, lower_right_mask
from titan_ulysses.ops.attention.per_document import attention_per_document
from titan_ulysses.ops.attention.sdpa_table import auto_causal

BLOCK = 1024
"""Query block of windowed / softcapped / lower-right calls: masks are [BLOCK, BLOCK + window] at most."""

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


def sdpa_priority(setting: str, masked: bool = False, head_dim: int = 0, seq_len: int = 0) -> tuple[str, ...]:
    """The order in which SDPA tries its kernels for ``model.sdpa_backends`` on this machine, for
    plain causal calls or, with ``masked``, calls with a dense (document) mask, at ``head_dim``
    and ``seq_len`` (the kernel call's key length; 0: unknown).

    ``()`` keeps PyTorch's (:func:`_pytorch_order`). ``"auto"`` on CUDA:

    * causal: the kernel measured fastest for this GPU, head_dim and length (``sdpa_table.py``:
      cuDNN on Hopper at head_dim 128 and 32K-128K tokens, 1.8x FlashAttention's rate on an
      H200); where nothing was measured, the order from before the table (cuDNN first on
      Hopper, PyTorch's order elsewhere), as the table says.
    * masked: the memory-efficient kernel first (FlashAttention takes no mask), not cuDNN,
      whose backward with an explicit mask returns NaN in dq for some lengths from torch 2.11
      on (pytorch/pytorch#196678); with is_causal and no mask it is clean.

    A list applies to both and is a preference, not a restriction: the kernels it leaves out
    follow in PyTorch's order, so that a shape the named kernels cannot take still runs.
    """
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return _resolve(parse_sdpa_backends(setting), setting == "auto", capability, masked, head_dim, seq_len,
                    _pytorch_order())


def _resolve(names, auto: bool, capability, masked: bool, head_dim: int, seq_len: int, rest) -> tuple[str, ...]:
    """:func:`sdpa_priority` from what it read of the machine (plain Python: called in every forward)."""
    if auto and capability is not None:
        names = ("efficient",) if masked else auto_causal(capability, head_dim, seq_len)[0]
    return tuple(names) + tuple([n for n in rest if n not in names]) if names else ()


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
        # what the kernel order depends on besides the call's shape, read once (not in forward)
        self._names, self._auto = parse_sdpa_backends(sdpa_backends), sdpa_backends == "auto"
        self._capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        self._rest = _pytorch_order()
        self.sdpa_backends = sdpa_backends

    backend_name = "sdpa"

    def order(self, masked: bool, head_dim: int = 0, seq_len: int = 0) -> list:
        """The SDPA kernels in the order they are tried for this call (empty: PyTorch's)."""
        names = _resolve(self._names, self._auto, self._capability, masked, head_dim, seq_len, self._rest)
        return [SDPA_KERNELS[n] for n in names]

    def _kernels(self, masked: bool, head_dim: int = 0, seq_len: int = 0):
        order = self.order(masked, head_dim, seq_len)
        return sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext()

    def forward(self, q, k, v, attention_mask=None, *, scale=None, window=0, softcap=0.0, sinks=None):
        """``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]`` -> ``[B, S, Hq, D]``, causal; ``sinks`` [Hq] or None;
        see the module."""
        if attention_mask is None:
            return self.causal_lower_right(q, k, v, scale=scale, window=window, softcap=softcap, sinks=sinks)
        if isinstance(attention_mask, DocumentMask):
            if attention_mask.dense is None:
                if sinks is not None:
                    raise ValueError("attention sinks with packed documents above the dense-mask size are not "
                                     "implemented for model.attn_backend 'sdpa'; set training.packing false")
                return attention_per_document(q, k, v, attention_mask.document_ids, attention_mask.spans_rows,
                                              attention_mask.query_runs, scale or 0.0, window, softcap, "sdpa",
                                              self.sdpa_backends)
            mask = attention_mask.dense
            if window > 0:  # [B, 1, S, S] & [S, S]
                mask = mask & lower_right_mask(q.shape[1], k.shape[1], window, q.device)
            return self._masked(q, k, v, mask, scale, softcap, sinks)
        if window > 0:  # an explicit mask (cp's dense path, tests) already says what is visible
            raise ValueError("SDPAAttention: pass the window inside an explicit boolean mask, not beside it")
        return self._masked(q, k, v, attention_mask, scale, softcap, sinks)

    def _masked(self, q, k, v, mask, scale, softcap, sinks=None):
        """Attention under an explicit boolean mask (``[Lq, Lk]`` or ``[B, 1, Lq, Lk]``)."""
        if softcap > 0 or sinks is not None:
            return _math(q, k, v, mask, scale, softcap, sinks)
        return self._sdpa(q, k, v, mask, scale)

    def _causal(self, q, k, v, scale):
        """Square causal attention, no mask: cuDNN / flash on CUDA."""
        return self._sdpa(q, k, v, None, scale)

    def _sdpa(self, q, k, v, mask, scale):
        """SDPA in the kernel order for masked (``mask``) or causal (``None``) calls, kv expanded where the
        CUDA kernels need it."""
        gqa = q.shape[2] != k.shape[2]
        if _cuda_needs_kv_expanded(q, k, mask is not None):
            k, v = _expand_kv(q, k, v)
            gqa = False
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        with self._kernels(mask is not None, q.shape[-1], k.shape[-2]):  # q, k: [B, H, S, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                 enable_gqa=gqa)
        return out.transpose(1, 2)  # [B, S, H, D]

    def causal_lower_right(self, q, k, v, *, scale=None, window=0, softcap=0.0, sinks=None):
        """Causal attention of the last ``Lq`` tokens of an ``Lk``-token prefix, the diagonal aligned bottom-right.

        ``q: [B, Lq, Hq, D]``, ``k, v: [B, Lk, Hkv, D]`` with ``Lq <= Lk``: query ``i`` sees keys
        ``0 .. i + Lk - Lq`` (and, with ``window``, only the last ``window`` of them). Context
        parallelism calls it for each chunk of a rank's queries against the gathered keys up
        to the chunk's end (``distributed/context_parallel.py``), packed documents per document.

        Plain tensors and ints only, so that selective activation checkpointing and
        ``torch.compile(fullgraph=True)`` take it (``torch.nn.attention.bias.causal_lower_right``
        does neither: its ``CausalBias`` is a tensor subclass built through the legacy
        constructor, which dynamo refuses and which fails under a dispatch mode -- and it
        allocates an uninitialised ``[2, Lq, Lk]`` fp32 tensor on every call).

        * square, no window, no softcap: sdpa's causal call (cuDNN / flash on CUDA);
        * CUDA, bf16/fp16, head size a multiple of 8 up to 256, no window or softcap: PyTorch's
          flash kernel, no mask. Its ``is_causal`` aligns the diagonal bottom-right when
          ``Lq != Lk`` (FlashAttention 2's convention); sdpa's front end refuses flash for
          non-square causal attention, so the aten op is called directly, as ``CausalBias``
          does. It takes GQA as is.
        * elsewhere: queries in blocks of ``BLOCK``, each against the keys it may see with an
          explicit boolean mask built from the lengths (``[block, block + window]`` with a window).
        """
        lq, lk = q.shape[1], k.shape[1]
        plain = softcap == 0 and sinks is None and (window <= 0 or window >= lk)
        if plain and lq == lk:
            return self._causal(q, k, v, scale)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        if plain and _flash_lower_right(qt):
            out = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False, scale=scale)[0]
            return out.transpose(1, 2)  # [B, Lq, Hq, D]
        off, outs = lk - lq, []
        for a in range(0, lq, BLOCK):
            b = min(a + BLOCK, lq)
            ks, ke = (max(0, a + off - window + 1) if window > 0 else 0), b + off
            mask = lower_right_mask(b - a, ke - ks, window, q.device)  # [block, keys it may see]
            outs.append(self._masked(q[:, a:b], k[:, ks:ke], v[:, ks:ke], mask, scale, softcap, sinks))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _math(q, k, v, mask, scale, softcap, sinks=None):
    """Explicit attention under ``mask``: Gemma 2's score capping ``softcap * tanh(s / softcap)`` (0: none),
    gpt-oss's ``sinks`` [Hq] (a logit per head in each row's softmax, whose probability is dropped)."""
    if q.shape[2] != k.shape[2]:
        k, v = _expand_kv(q, k, v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    scores = (qt @ kt.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, H, Lq, Lk]
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [B, H, Lq, 1]
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # [B, H, Lq, Lk]
    return (probs.to(vt.dtype) @ vt).transpose(1, 2)  # [B, Lq, Hq, D]
