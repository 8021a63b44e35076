"""Local attention backends: the swap point inside every attention layer.

Every backend is a module ``inner_attention(q, k, v, attention_mask=None, *, scale=None,
window=0, softcap=0.0)`` over ``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]`` (Hq a multiple of
Hkv) returning ``[B, S, Hq, D]``, causal. ``window=W > 0``: query ``i`` sees keys ``j`` with
``i - W < j <= i`` (Hugging Face ``sliding_window``); ``softcap > 0``: scores become
``softcap * tanh(scores / softcap)`` (Gemma 2); ``scale``: the softmax scale (None:
``1/sqrt(D)``). ``attention_mask`` is the per-step mask object of
:func:`build_attention_mask` (from document ids of the full sequence; None: one document).

The backends (``sdpa.py``, ``flex.py``, ``flash_attn.py``) and what each can do are listed in
``registry.py``; nothing outside this package switches on a backend's name.
"""

from titan_ulysses.ops.attention.masks import DENSE_MASK_MAX_ELEMENTS, DocumentMask, cu_seqlens_from_document_ids
from titan_ulysses.ops.attention.registry import (
    BACKENDS,
    Backend,
    build_attention,
    build_attention_mask,
    check_attention_settings,
    get_backend,
    save_ops,
)
from titan_ulysses.ops.attention.sdpa import SDPA_KERNELS, SDPAAttention, parse_sdpa_backends, sdpa_priority

__all__ = ["BACKENDS", "Backend", "DENSE_MASK_MAX_ELEMENTS", "DocumentMask", "SDPAAttention", "SDPA_KERNELS",
           "build_attention", "build_attention_mask", "check_attention_settings", "cu_seqlens_from_document_ids",
           "get_backend", "parse_sdpa_backends", "save_ops", "sdpa_priority"]
