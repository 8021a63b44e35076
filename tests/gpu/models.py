"""GPU-suite cases of the models (``gpu_suite.py --part first``): every family's bf16 logits against
transformers on the device, and the MoE grouped kernel against its loop over experts."""

from __future__ import annotations

import tempfile

import torch

from benchmarks.gpu_common import rel_err


# ---- every family's bf16 logits against transformers ------------------------------------------

def families_bf16(ctx):
    """Each family's variants (tests/hf_fixtures.py) at tiny shapes on the device: our bf16 logits
    against transformers' fp32, beside transformers' own bf16 error; our fp32 within 1e-4."""
    from hf_fixtures import FAMILY_VARIANTS, VARIANTS, make_hf_model

    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.models.registry import build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    variants = {**{k: v for k, v in VARIANTS.items()}, **FAMILY_VARIANTS}
    if ctx.dry_run:
        variants = dict(list(variants.items())[:2])
    figures, ok = {}, True
    tokens = torch.randint(1, 320, (2, 48), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    for name, (model_type, overrides, _) in variants.items():
        with tempfile.TemporaryDirectory() as folder:
            hf = make_hf_model(folder, model_type, overrides).to(ctx.device)
            with torch.no_grad():
                want = hf(tokens).logits.float()
                hf_bf16 = rel_err(hf.to(torch.bfloat16)(tokens).logits, want)
            ours = build_model(load_hf_args(folder), ComputeOptions(attn_backend="sdpa"))
            load_hf_weights(ours, folder)
            ours.to(ctx.device)
            ours.init_buffers(ctx.device) if hasattr(ours, "init_buffers") else None
            with torch.no_grad():
                fp32 = rel_err(ours(tokens), want)
                bf16 = rel_err(ours.to(torch.bfloat16)(tokens), want)
        # bf16 roundoff differs in order between the two implementations: within 2x transformers' own + 2e-3
        good = fp32 < 1e-4 and bf16 < 2 * hf_bf16 + 2e-3
        figures[name] = {"fp32": fp32, "bf16": bf16, "hf_bf16": hf_bf16}
        ok &= good
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": "2 x 48 tokens, trained-like weights, sdpa; rel. error of logits vs transformers fp32 (eager): "
                      "ours fp32 < 1e-4 (TF32 off), ours bf16 < 2 x transformers' bf16 + 2e-3"}


# ---- mixture of experts: the grouped kernel against its loop ---------------------------------

def moe_grouped_mm(ctx):
    """``torch._grouped_mm`` (what the experts run on sm90+ in bf16) against the exact loop over experts,
    forward and backward, with an expert that gets no rows; then a whole MoE feed-forward both ways."""
    from titan_ulysses.models.moe.args import MoEArgs
    from titan_ulysses.models.moe.feed_forward import MoEFeedForward
    from titan_ulysses.ops.grouped_mm import grouped_mm, grouped_mm_available

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    t, d, f, e = (64, 16, 8, 4) if ctx.dry_run else (8192, 2048, 768, 16)
    g = torch.Generator().manual_seed(0)
    rows_expert = torch.randint(0, e, (t,), generator=g)
    rows_expert[rows_expert == 1] = 0  # expert 1 gets no rows
    counts = torch.bincount(rows_expert, minlength=e)
    x0, w0 = torch.randn(t, d, generator=g), torch.randn(e, d, f, generator=g) / d ** 0.5
    gy = torch.randn(t, f, generator=g)
    # CPU (the dry run): the kernel's forward, which exists there in fp32
    kernel = grouped_mm_available(x0.to(ctx.device, dtype), w0.to(ctx.device, dtype)) or not ctx.cuda
    if not kernel:
        return {"status": "skipped", "detail": "torch._grouped_mm does not take these operands on this GPU"}
    figures, ok = {}, True
    runs = {}
    for name, use in (("loop", False), ("kernel", kernel)):
        x, w = (a.to(ctx.device, dtype).requires_grad_(ctx.cuda) for a in (x0, w0))
        y = grouped_mm(x, w, counts.to(ctx.device), kernel=use)
        if ctx.cuda:
            y.backward(gy.to(ctx.device, dtype))
        runs[name] = [y.detach()] + ([x.grad, w.grad] if ctx.cuda else [])
    for i, what in enumerate(("y", "dx", "dw")[:len(runs["loop"])]):
        figures[f"{what}_err"] = rel_err(runs["kernel"][i], runs["loop"][i])
        ok &= figures[f"{what}_err"] < 1e-2
    args = MoEArgs(e, 2, f)
    torch.manual_seed(0)
    moe = MoEFeedForward(d, args)
    moe.init_weights(std=0.05)
    moe.to(ctx.device, dtype)
    xs = torch.randn(2, t // 2, d, generator=g).to(ctx.device, dtype)
    outs = []
    for use in (False, kernel):
        moe.experts.kernel = use
        outs.append(moe(xs)[0].detach())
    figures["moe_err"] = rel_err(outs[1], outs[0])
    ok &= figures["moe_err"] < 1e-2
    return {"status": "pass" if ok else "fail", "figures": {**figures, "kernel": kernel},
            "detail": f"{str(dtype).removeprefix('torch.')} [{t}, {d}] x {e} experts [{d}, {f}] (one with no rows), "
                      f"fwd{'+bwd' if ctx.cuda else ''}; then a top-2 MoE feed-forward; kernel vs loop < 1e-2 (rel.)"}
