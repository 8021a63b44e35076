"""``loss_fused_bf16``: the fused loss's CUDA path (its compiled fp32 pass, ``dW`` through an fp32-output
matmul of bf16 operands) against an fp64 reference, beside the materialised bf16 loss's own error.

Per case (plain; a quarter of the rows ignored, a whole chunk among them, with Gemma 2's softcap 30):
the loss and both gradients in bf16 inputs; the fused one must be within 2x the materialised bf16
loss's error against fp64 (plus 1e-3 for the loss, whose bf16 logits round the same way in both).
A dry run (CPU, CI) runs the eager reference path at toy size.
"""

from __future__ import annotations

import torch

from benchmarks.gpu_common import rel_err
from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy_sum, softcapped


def _run(fn, h, w, labels, softcap, dtype):
    h, w = h.to(dtype, copy=True).requires_grad_(), w.to(dtype, copy=True).requires_grad_()
    loss = fn(h, w, labels, softcap)
    (loss / labels.numel()).backward()
    return [loss.detach().double(), h.grad.double(), w.grad.double()]


def loss_fused_bf16(ctx):
    n, v, d, chunk = (48, 40, 16, 16) if ctx.dry_run else (4096, 32768, 1024, 1024)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64).to(ctx.device)
    w = (torch.randn(v, d, generator=gen, dtype=torch.float64) * d ** -0.5 * 4).to(ctx.device)
    labels = torch.randint(0, v, (n,), generator=gen).to(ctx.device)
    figures, worst = {}, 0.0

    def reference(h_, w_, lab, softcap):
        return cross_entropy_sum(softcapped(h_ @ w_.t(), softcap)[None], lab[None])

    def materialized(h_, w_, lab, softcap):
        return linear_cross_entropy_sum(h_, w_, lab, backend="materialized", softcap=softcap)

    def fused(h_, w_, lab, softcap):
        return linear_cross_entropy_sum(h_, w_, lab, backend="fused", chunk_size=chunk, softcap=softcap)

    for case, softcap in (("plain", None), ("ignored_softcap", 30.0)):
        lab = labels.clone()
        if softcap:
            lab[: n // 4] = IGNORE_INDEX  # a whole chunk and part of the next
        ref = _run(reference, h, w, lab, softcap, torch.float64)
        base = [rel_err(a, b) for a, b in zip(_run(materialized, h, w, lab, softcap, dtype), ref)]
        ours = [rel_err(a, b) for a, b in zip(_run(fused, h, w, lab, softcap, dtype), ref)]
        for what, o, b in zip(("loss", "grad_h", "grad_w"), ours, base):
            figures[f"{case}_{what}_err"], figures[f"{case}_{what}_materialized_err"] = o, b
            worst = max(worst, o / (2 * b + (1e-3 if what == "loss" else 1e-6)))
    ok = worst <= 1.0
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": f"{n} tokens x vocab {v} x dim {d}, chunks of {chunk}, {str(dtype).removeprefix('torch.')}; "
                      f"fused within 2x the materialised loss's error against fp64 (worst ratio {worst:.2f})"}
