"""The ``flex`` backend: FlexAttention with a BlockMask built from block-level summaries, never dense.

``create_block_mask`` evaluates the mask_mod over every (query, key) pair in eager mode --
a ``[B, 1, S, S]`` bool tensor (16 GiB at 128K) before it reduces it to blocks. Here the block
structure is computed from per-block minima and maxima instead (:func:`block_mask`): a query
block and a key block hold visible pairs only if their documents (runs of equal ids, numbered
in order) overlap, the causal order allows it and the window reaches; they are *full* when
every pair is visible. Partial blocks apply the exact ``mask_mod``. That costs
``[B, S/128, S/128]`` booleans (1M per row at 128K) and works for any query and key order, so
context parallelism passes the global indices of its load-balanced chunks.

``softcap`` is a ``score_mod``; ``window`` is in the mask (one BlockMask per window, cached in
the step's mask object). FlexAttention has no CPU backward (PyTorch 2.13): CPU runs forward only.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.ops.attention.masks import DocumentMask

FLEX_BLOCK = 128


def document_runs(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids -> ``[B, S]`` run numbers, non-decreasing (padding's -1 is a run of its own)."""
    starts = torch.ones_like(document_ids, dtype=torch.int32)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).int()
    return starts.cumsum(1, dtype=torch.int32)


def _block_min_max(x: torch.Tensor, n_blocks: int):
    """``[..., L]`` -> per block of FLEX_BLOCK along the last dim, (min, max) ``[..., n_blocks]``."""
    pad = n_blocks * FLEX_BLOCK - x.shape[-1]  # indices and run numbers lie in [0, 2**30): pads never win
    lo = torch.nn.functional.pad(x, (0, pad), value=2**30) if pad else x
    hi = torch.nn.functional.pad(x, (0, pad), value=-1) if pad else x
    return (lo.view(*x.shape[:-1], n_blocks, FLEX_BLOCK).amin(-1),
            hi.view(*x.shape[:-1], n_blocks, FLEX_BLOCK).amax(-1))


def block_mask(document_ids, q_index: torch.Tensor, k_index: torch.Tensor, window: int = 0):
    """The BlockMask of queries at global indices ``q_index`` ``[Lq]`` against keys ``k_index``
    ``[Lk]``: causal, within ``window``, within documents when ``document_ids`` ``[B, S]`` is given."""
    from torch.nn.attention.flex_attention import _create_sparse_block_from_block_mask

    lq, lk = q_index.numel(), k_index.numel()
    nq, nk = -(-lq // FLEX_BLOCK), -(-lk // FLEX_BLOCK)
    qmin, qmax = (t[:, None] for t in _block_min_max(q_index, nq))  # [nQ, 1]
    kmin, kmax = (t[None, :] for t in _block_min_max(k_index, nk))  # [1, nK]
    any_ok, all_ok = qmax >= kmin, qmin >= kmax  # causal
    if window > 0:
        any_ok, all_ok = any_ok & (qmin - kmax < window), all_ok & (qmax - kmin < window)
    any_ok, all_ok = any_ok[None], all_ok[None]  # [1, nQ, nK]
    runs = None
    if document_ids is not None:
        runs = document_runs(document_ids)  # [B, S]
        rq_min, rq_max = _block_min_max(runs[:, q_index], nq)  # [B, nQ]
        rk_min, rk_max = _block_min_max(runs[:, k_index], nk)  # [B, nK]
        any_ok = any_ok & (rq_max[:, :, None] >= rk_min[:, None, :]) & (rq_min[:, :, None] <= rk_max[:, None, :])
        all_ok = all_ok & (rq_min[:, :, None] == rq_max[:, :, None]) & (rk_min[:, None, :] == rk_max[:, None, :]) \
            & (rq_min[:, :, None] == rk_min[:, None, :])
    # indices past the ends (the last partial block) read a valid entry; flex masks them itself
    qi = torch.nn.functional.pad(q_index, (0, nq * FLEX_BLOCK - lq))
    ki = torch.nn.functional.pad(k_index, (0, nk * FLEX_BLOCK - lk))

    def mask_mod(b, h, q_idx, kv_idx):
        gq, gk = qi[q_idx], ki[kv_idx]
        ok = gq >= gk
        if window > 0:
            ok = ok & (gq - gk < window)
        if runs is not None:
            ok = ok & (runs[b, gq] == runs[b, gk])
        return ok

    full = all_ok[:, None].clone()  # [B, 1, nQ, nK]
    if lq % FLEX_BLOCK:  # a block that runs past the end is never full: mask_mod sees its real part
        full[:, :, -1] = False
    if lk % FLEX_BLOCK:
        full[:, :, :, -1] = False
    partial = any_ok[:, None] & ~full
    return _create_sparse_block_from_block_mask((partial, full), mask_mod, (lq, lk), FLEX_BLOCK, FLEX_BLOCK)


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


def _softcap_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


class FlexAttention(nn.Module):
    def forward(self, q, k, v, attention_mask=None, *, scale=None, window=0, softcap=0.0):
        """``q: [B, S, Hq, D]``, ``k, v: [B, S, Hkv, D]`` -> ``[B, S, Hq, D]``, causal; see the module."""
        if attention_mask is None or isinstance(attention_mask, DocumentMask):
            index = torch.arange(q.shape[1], device=q.device)
            mask = self.block_mask_for(attention_mask, index, index, window)
        else:  # a BlockMask built by the caller
            mask = attention_mask
        return self.attend(q, k, v, mask, scale=scale, softcap=softcap)

    def block_mask_for(self, attention_mask, q_index, k_index, window: int = 0):
        """The BlockMask of queries at global indices ``q_index`` against keys at ``k_index`` (context
        parallelism passes its load-balanced chunks'), cached per window in the step's mask object."""
        docs = None if attention_mask is None else attention_mask.document_ids
        if attention_mask is None or torch.compiler.is_compiling():  # traced: built in the graph, per call
            return block_mask(docs, q_index, k_index, window)
        return attention_mask.cached(("flex", window, q_index.numel(), k_index.numel()), lambda: block_mask(
            attention_mask.document_ids, q_index, k_index, window))

    def attend(self, q, k, v, mask, *, scale=None, softcap=0.0):
        """FlexAttention under a ready BlockMask (any query/key lengths)."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        out = _flex_kernel(q.is_cuda)(
            q, k, v, score_mod=_softcap_mod(softcap) if softcap > 0 else None, block_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.transpose(1, 2)  # [B, S, H, D]
