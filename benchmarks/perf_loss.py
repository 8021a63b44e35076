"""``perf_loss`` (in ``first``): every loss backend of ``ops/loss/registry.py``, fwd+bwd time and peak.

At 16K tokens x vocab 128256 x dim 2048 (Llama-3 1B's head) and 32K x 152064 x 3584 (Qwen2.5-7B's), bf16,
one GPU: ``fused`` (ours, the default), ``liger`` (fp32 accumulation), ``cce``, ``chunked`` (the old
default) and ``materialized``, each through ``linear_cross_entropy_sum`` as the model's head calls it,
normalised by the token count, both gradients made. Per backend and shape: the median ms of 5 steps
after one warm-up (fused's first call compiles), the peak above the inputs (GiB), and the loss's
relative difference from fused's. A backend that cannot run here (package missing, no CUDA) reports
why; one that runs out of memory reports ``oom``. Target (issue 47): fused <= 40 ms at the first shape
on an H100 (Liger measured 48.1 ms there on 2026-11-28); not measured yet.

A dry run (CPU, CI) runs the torch backends at toy size.
"""

from __future__ import annotations

import statistics
import time

import torch

from titan_ulysses.ops.loss import BACKENDS, linear_cross_entropy_sum
from titan_ulysses.ops.loss.registry import loss_backend_problem

SHAPES = {"16k": (16384, 128256, 2048), "32k": (32768, 152064, 3584)}
"""name -> (tokens, vocab, dim)"""
TOY = {"16k": (64, 96, 32), "32k": (80, 112, 24)}


def _measure(name: str, n: int, v: int, d: int, ctx, dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=gen).to(ctx.device, dtype).requires_grad_()
    w = (torch.randn(v, d, generator=gen) * d ** -0.5).to(ctx.device, dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen).to(ctx.device)

    def step():
        h.grad = w.grad = None
        loss = linear_cross_entropy_sum(h, w, labels, backend=name) / n
        loss.backward()
        return loss.detach()

    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = step()  # warm-up (compiles)
    times = []
    for _ in range(1 if ctx.dry_run else 5):
        if ctx.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if ctx.cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if ctx.cuda else None  # (no CPU peak)
    return {"ms": statistics.median(times) * 1e3, "peak_gib": peak, "loss": float(loss)}


def perf_loss(ctx):
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    figures, notes = {}, {}
    for tag, (n, v, d) in (TOY if ctx.dry_run else SHAPES).items():
        rows = {}
        for name in BACKENDS:
            problem = loss_backend_problem(name, device_type=ctx.device.type)
            if problem:
                figures[f"{name}_{tag}_ms"] = "unavailable"
                notes[name] = problem
                continue
            try:
                rows[name] = _measure(name, n, v, d, ctx, dtype)
            except torch.OutOfMemoryError:
                figures[f"{name}_{tag}_ms"] = "oom"
            finally:
                if ctx.cuda:
                    torch.cuda.empty_cache()
        for name, r in rows.items():
            figures[f"{name}_{tag}_ms"] = round(r["ms"], 2)
            if r["peak_gib"] is not None:
                figures[f"{name}_{tag}_peak_gib"] = round(r["peak_gib"], 2)
            if "fused" in rows and name != "fused":
                fused = rows["fused"]["loss"]
                figures[f"{name}_{tag}_loss_rel_diff"] = abs(r["loss"] - fused) / abs(fused)
    shapes = ", ".join(f"{tag}: {n} tokens x vocab {v} x dim {d}" for tag, (n, v, d) in
                       (TOY if ctx.dry_run else SHAPES).items())
    return {"status": "measured", "figures": figures,
            "detail": f"fwd+bwd, {str(dtype).removeprefix('torch.')}, {shapes}; median of 5 after a warm-up, peak "
                      f"above the inputs; target fused <= 40 ms at 16k on an H100"
                      + "".join(f"; {why}" for why in notes.values())}
