"""GPU-suite cases of the attention paths without a dense mask (``gpu_suite.py --part correctness``).

Each case runs a backend's own kernels on packed documents with a sliding window and score
capping, against attention written out in fp32 from its definition (causal, ``i - W < j``,
same document, ``softcap * tanh(s / softcap)``), and reports ``bug_err``: the error a key
leaking across a document boundary would give, so the tolerance is shown to catch it.

* ``attn_<backend>_docs_window_softcap``: the local call (sdpa per document above 16M mask
  elements; flex's BlockMask from block ranges, whose full and skipped blocks only the fused
  CUDA kernel trusts -- the CPU tests check the block structure, this the kernel; flash_attn varlen).
* ``attn_<backend>_cp4_docs_window``: context parallelism's per-rank call for each of 4 cp ranks in
  one process (the K/V all-gather replaced by the gathered tensor), queries at the global
  positions of the load-balanced chunks.
"""

from __future__ import annotations

import math
from unittest import mock

import torch

from benchmarks.gpu_common import Case, Skip, exact_fp32, rel_err

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _documents(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.rand(b, s, generator=gen) < 8 / s
    starts[:, 0] = True
    return starts.long().cumsum(1)  # [B, S], ~8 documents per row, rows that differ


def reference(q, k, v, docs, window, softcap):
    """fp32 attention from its definition: ``[B, S, Hq, D]`` -> ``[B, S, Hq, D]``."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    q, k, v = q.float(), k.float().repeat_interleave(rep, 2), v.float().repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s, device=q.device)
    ok = (i[:, None] >= i[None]) & ((i[:, None] - i[None] < window) if window else True)
    ok = ok[None] & (docs[:, :, None] == docs[:, None, :]) if docs is not None else ok[None]
    return torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~ok[:, None], -math.inf).softmax(-1), v)


def _needs(backend: str, ctx) -> None:
    if backend == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise Skip("flash-attn is not installed on this machine")


def local_case(backend: str, window_: int, softcap: float):
    def run(ctx):
        from titan_ulysses.ops.attention import build_attention, build_attention_mask

        _needs(backend, ctx)
        exact_fp32()
        b, s, hq, hkv, d = (2, 256, 4, 2, 16) if ctx.dry_run else (2, 4096, 8, 2, 128)
        window = window_ if not ctx.dry_run else min(window_, 50)  # the dry run's window cuts too
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(b, s, h, d, generator=gen) * 2 for h in (hq, hkv, hkv)]
        grad = torch.randn(b, s, hq, d, generator=gen)
        docs = _documents(b, s, gen).to(ctx.device)
        backward = ctx.cuda or backend == "sdpa"
        dtypes = (torch.bfloat16,) if backend == "flash_attn" else (torch.bfloat16, torch.float32)
        module, figures, ok = build_attention(backend), {}, True
        for dtype in dtypes if ctx.cuda else (torch.float32,):
            q, k, v = (t.to(ctx.device, dtype).requires_grad_(backward) for t in base)
            mask = build_attention_mask(backend, docs)
            out = module(q, k, v, mask, window=window, softcap=softcap)
            leaves = [t.detach().float().requires_grad_(backward) for t in (q, k, v)]
            ref = reference(*leaves, docs, window, softcap)
            got, refs = [out], [ref]
            if backward:
                out.backward(grad.to(ctx.device, dtype))
                ref.backward(grad.to(ctx.device))
                got += [q.grad, k.grad, v.grad]
                refs += [t.grad for t in leaves]
            err = max(rel_err(x, r) for x, r in zip(got, refs))
            figures[f"{str(dtype).removeprefix('torch.')}_err"] = err
            ok &= err < TOL[dtype]
        bug = rel_err(reference(*leaves, None, window, softcap), ref)  # documents ignored
        figures["bug_err"] = bug
        ok &= bug > 10 * TOL[torch.bfloat16]
        return {"status": "pass" if ok else "fail", "figures": figures,
                "detail": f"[{b}, {s}, {hq}/{hkv} heads, {d}] packed documents, window {window}, softcap {softcap}, "
                          f"{'fwd+bwd' if backward else 'fwd only'} vs fp32 definition; bf16 < {TOL[torch.bfloat16]:g}, "
                          f"fp32 < {TOL[torch.float32]:g}; ignoring documents gives bug_err"}

    return run


class _OneRankOfCp:
    """What ContextParallelAttention reads of its mesh, for rank ``rank`` of ``size``."""

    ndim = 1

    def __init__(self, rank, size):
        self.rank, self.n = rank, size

    def size(self):
        return self.n

    def get_local_rank(self):
        return self.rank

    def get_group(self):
        return None


def cp_case(backend: str, window_: int, softcap: float, cp: int = 4):
    def run(ctx):
        from titan_ulysses.data.sharding import load_balanced_order
        from titan_ulysses.distributed import context_parallel
        from titan_ulysses.ops.attention import build_attention, build_attention_mask

        _needs(backend, ctx)
        exact_fp32()
        b, s, hq, hkv, d = (1, 256, 4, 2, 16) if ctx.dry_run else (1, 8192, 8, 2, 128)
        window = window_ if not ctx.dry_run else min(window_, 50)
        dtype = torch.bfloat16 if ctx.cuda else torch.float32
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(b, s, h, d, generator=gen).to(ctx.device, dtype) * 2 for h in (hq, hkv, hkv))
        docs = _documents(b, s, gen).to(ctx.device)
        ref = reference(q, k, v, docs, window, softcap)
        order = load_balanced_order(s, cp, ctx.device)
        gathered = torch.cat([k, v], dim=2)[:, order]  # what the all-gather returns: [B, S, 2 Hkv, D]
        worst = 0.0
        with mock.patch.object(context_parallel, "all_gather_seq", lambda x, group, n: gathered):
            for rank in range(cp):
                attn = context_parallel.ContextParallelAttention(build_attention(backend), _OneRankOfCp(rank, cp))
                mine = order.view(cp, -1)[rank]
                out = attn(q[:, mine], k[:, mine], v[:, mine], build_attention_mask(backend, docs), window=window,
                           softcap=softcap)
                worst = max(worst, rel_err(out, ref[:, mine]))
        bug = rel_err(reference(q, k, v, None, window, softcap), ref)
        ok = worst < TOL[dtype] and bug > 10 * TOL[dtype]
        return {"status": "pass" if ok else "fail", "figures": {"err": worst, "bug_err": bug},
                "detail": f"cp {cp} ranks' calls in one process, [{b}, {s}, {hq}/{hkv} heads, {d}] "
                          f"{str(dtype).removeprefix('torch.')} packed documents, window {window}, softcap {softcap}, "
                          f"fwd vs fp32 definition < {TOL[dtype]:g}; ignoring documents gives bug_err"}

    return run


CASES = [
    Case("attn_sdpa_docs_window_softcap", local_case("sdpa", 1024, 30.0), 20, 3),
    Case("attn_sdpa_docs_window", local_case("sdpa", 1024, 0.0), 20, 3),
    Case("attn_flex_docs_window_softcap", local_case("flex", 1024, 30.0), 90, 5),
    Case("attn_flash_attn_docs_window_softcap", local_case("flash_attn", 1024, 30.0), 10, 1),
    Case("attn_sdpa_cp4_docs_window", cp_case("sdpa", 1024, 0.0), 30, 3),
    Case("attn_flex_cp4_docs_window_softcap", cp_case("flex", 1024, 30.0), 120, 5),
    Case("attn_flash_attn_cp4_docs_window", cp_case("flash_attn", 1024, 0.0), 20, 1),
]
