"""The ``flash_attn`` backend: the flash-attn package (CUDA only, optional extra ``[flash]``).

Causal calls align the diagonal bottom-right when the queries are fewer than the keys
(FlashAttention 2's convention), which is what context parallelism's per-chunk calls need;
``window`` is its ``window_size=(window - 1, 0)``, ``softcap`` its ``softcap``; packed
documents run through ``flash_attn_varlen_func`` with cumulative sequence lengths.
"""

from __future__ import annotations

from torch import nn

from titan_ulysses.ops.attention.masks import DocumentMask


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


def _window(window: int) -> tuple[int, int]:
    return (window - 1, 0) if window > 0 else (-1, -1)


class FlashAttnAttention(nn.Module):
    backend_name = "flash_attn"
    sdpa_backends = "auto"  # unused; the per-document op's signature

    def __init__(self):
        super().__init__()
        _import_flash_attn()

    def forward(self, q, k, v, attention_mask=None, *, scale=None, window=0, softcap=0.0):
        """``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]`` -> ``[B, S, Hq, D]``, causal; see the module."""
        if attention_mask is None:
            return self.causal_lower_right(q, k, v, scale=scale, window=window, softcap=softcap)
        if not isinstance(attention_mask, DocumentMask) or attention_mask.cu_seqlens is None:
            raise ValueError("attn_backend 'flash_attn' takes the mask of build_attention_mask('flash_attn', ...)")
        cu_seqlens, max_seqlen = attention_mask.cu_seqlens
        b, s = q.shape[:2]
        flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]  # batch rows concatenated
        out = _import_flash_attn().flash_attn_varlen_func(
            *flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=True,
            window_size=_window(window), softcap=softcap,
        )
        return out.reshape(b, s, *out.shape[1:])

    def causal_lower_right(self, q, k, v, *, scale=None, window=0, softcap=0.0):
        """``q: [B, Lq, Hq, D]`` against ``k, v: [B, Lk, Hkv, D]``, ``Lq <= Lk``, diagonal bottom-right."""
        return _import_flash_attn().flash_attn_func(
            q, k, v, softmax_scale=scale, causal=True, window_size=_window(window), softcap=softcap
        )
