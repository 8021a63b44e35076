"""Correctness cases of the GPU suite (``gpu_suite.py --part correctness``).

Every case compares a CUDA path with a reference and states its tolerance; where it
helps, it also reports what a known bug would look like (``bug_err``), so the tolerance
is shown to be tight enough to catch one.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu_common import Case, Skip, exact_fp32, rel_err
from titan_ulysses.ops.attention import build_attention, build_attention_mask

from .attention import CASES as ATTENTION_CASES
from .hf_trainer import hf_sft_ulysses_bf16
from .hf_ulysses import hf_llama_ulysses_bf16
from .loss import loss_fused_bf16
from .multirank import multiprocess_one_gpu
from .trainer_runs import checkpoint_async_pinned_resume, compile_memory_switches, float8_case, trainer_1b

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
bf16_fp32 = (torch.bfloat16, torch.float32)


# ---- local attention backends against an fp32 reference ---------------------------------

def _documents(b: int, s: int, gen: torch.Generator) -> torch.Tensor:
    """Document ids [B, S]: each row cut at random places into 3 to 6 documents."""
    rows = []
    for _ in range(b):
        cuts = torch.randperm(s - 1, generator=gen)[: int(torch.randint(2, 6, (1,), generator=gen))] + 1
        ids = torch.zeros(s, dtype=torch.long)
        ids[cuts] = 1
        rows.append(ids.cumsum(0))
    return torch.stack(rows)


def _dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, causal within documents: the reference's mask (sdpa itself builds none at 4K x 2)."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def _reference(q, k, v, grad, dense_mask):
    """fp32 math attention: output and input gradients. ``dense_mask`` None means causal."""
    q, k, v = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))  # [B, H, S, D]
    with sdpa_kernel([SDPBackend.MATH]):
        if dense_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, enable_gqa=True)
    out.backward(grad.float().transpose(1, 2))
    return [t.transpose(1, 2) for t in (out.detach(), q.grad, k.grad, v.grad)]


def attention_case(backend: str, kernel: SDPBackend | None, docs: bool, dtypes: tuple):
    def run(ctx):
        if backend == "flash_attn":
            try:
                import flash_attn  # noqa: F401
            except ImportError:
                raise Skip("flash-attn is not installed on this machine")
        if not ctx.cuda and kernel in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            raise Skip(f"{kernel.name} is a CUDA kernel")
        exact_fp32()
        b, s, hq, hkv, d = (2, 128, 4, 2, 16) if ctx.dry_run else (2, 4096, 8, 2, 128)
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(b, s, h, d, generator=gen) for h in (hq, hkv, hkv)]
        grad = torch.randn(b, s, hq, d, generator=gen)
        doc_ids = _documents(b, s, gen).to(ctx.device) if docs else None
        dense = _dense_mask(doc_ids) if docs else None
        module = build_attention(backend)
        figures, ok = {}, True
        # FlexAttention has no CPU backward: the dry run checks its forward only
        backward = ctx.cuda or backend != "flex"
        for dtype in dtypes:
            q, k, v = (t.to(ctx.device, dtype).requires_grad_(backward) for t in base)
            g = grad.to(ctx.device, dtype)
            ref = _reference(q, k, v, g, dense)
            mask = build_attention_mask(backend, doc_ids) if docs else None
            with sdpa_kernel([kernel]) if kernel is not None else contextlib.nullcontext():
                out = module(q, k, v, mask)
                if backward:
                    out.backward(g)
            got = (out, q.grad, k.grad, v.grad) if backward else (out,)
            err = max(rel_err(x, r) for x, r in zip(got, ref))
            name = str(dtype).removeprefix("torch.")
            figures[f"{name}_err"] = err
            ok &= err < TOL[dtype]
        # what a wrong mask looks like: causal instead of per-document, or no mask instead of causal
        wrong = None if docs else torch.ones(s, s, dtype=torch.bool, device=ctx.device)
        bug = rel_err(_reference(q, k, v, g, wrong)[0], ref[0])
        figures["bug_err"] = bug
        ok &= bug > 10 * max(TOL[t] for t in dtypes)
        tol = ", ".join(f"{str(t).removeprefix('torch.')} < {TOL[t]:g}" for t in dtypes)
        return {"status": "pass" if ok else "fail", "figures": figures,
                "detail": f"[{b}, {s}, {hq}/{hkv} heads, {d}] {'fwd+bwd' if backward else 'fwd only'} vs fp32 math; "
                          f"max rel. error of out{', dq, dk, dv' if backward else ''}: "
                          f"{tol}; a wrong mask gives bug_err"}

    return run


def sdpa_priority_case(ctx):
    """``model.sdpa_backends = "auto"``: which SDPA kernel the module runs for a causal call (cuDNN
    on Hopper) and for a document-masked one (memory-efficient on CUDA), and their numbers."""
    from torch.profiler import ProfilerActivity, profile

    from titan_ulysses.ops.attention import sdpa_priority

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    module = build_attention("sdpa", "auto")
    gen = torch.Generator().manual_seed(0)
    figures, ok, ran_all = {}, True, {}
    # causal at 16K with the 8B's heads at sp=8 (fp32 math reference: 4 GiB per score matrix);
    # document-masked at 4K
    for masked, s in ((False, 128 if ctx.dry_run else 16384), (True, 128 if ctx.dry_run else 4096)):
        b, hq, hkv, d = (1, 4, 1, 16) if ctx.dry_run else (1, 4, 1, 128)
        q, k, v = (torch.randn(b, s, h, d, generator=gen).to(ctx.device, dtype).requires_grad_()
                   for h in (hq, hkv, hkv))
        g = torch.randn(b, s, hq, d, generator=gen).to(ctx.device, dtype)
        doc_ids = _documents(b, s, gen).to(ctx.device) if masked else None
        mask = build_attention_mask("sdpa", doc_ids) if masked else None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
        with profile(activities=activities) as prof:
            out = module(q, k, v, mask)
            out.backward(g)
        ran = sorted({e.name.removeprefix("aten::_scaled_dot_product_") for e in prof.events()
                      if e.name.startswith("aten::_scaled_dot_product") and "backward" not in e.name})
        err = max(rel_err(x, r) for x, r in zip((out, q.grad, k.grad, v.grad),
                                                   _reference(q, k, v, g, _dense_mask(doc_ids) if masked else None)))
        order = sdpa_priority("auto", masked, d, s)
        want = order[0] if order else "flash"  # PyTorch's order: its flash kernel (CPU: flash_attention_for_cpu)
        kind = "masked" if masked else "causal"
        figures[f"{kind}_order"], figures[f"{kind}_err"] = ",".join(order) or "pytorch", err
        ran_all[kind] = ran
        ok &= any(name.startswith(want) for name in ran) and err < TOL[dtype]
    ok &= _measured_kernels_run(ctx, module, figures)
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": f"{str(dtype).removeprefix('torch.')} fwd+bwd through SDPAAttention with model.sdpa_backends "
                      f"'auto', GQA 4/1 heads: ran {ran_all}; the first kernel of each order must run; max rel. "
                      f"error of out, dq, dk, dv vs fp32 math < {TOL[dtype]:g}; measured_*: at each row of "
                      f"ops/attention/sdpa_table.py for this GPU, the kernel measured fastest runs"}


def _measured_kernels_run(ctx, module, figures: dict) -> bool:
    """For every row of the table for this GPU (its shortest measured length), the row's kernel runs a
    causal fwd+bwd of ``module`` (sdpa, "auto"). On CPU (dry run): a toy row's shape, the CPU's kernel."""
    from torch.profiler import ProfilerActivity, profile

    from titan_ulysses.ops.attention.sdpa_table import MEASURED, arch_of

    if ctx.cuda:
        arch = arch_of(torch.cuda.get_device_capability())
        rows = [(r.head_dim, r.min_len, r.fastest) for r in MEASURED if r.arch == arch]
    else:
        rows = [(16, 128, "flash")]  # PyTorch's CPU order: its flash kernel
    ok = True
    for d, s, fastest in rows:
        q, k, v = (torch.randn(1, s, h, d, device=ctx.device, dtype=torch.bfloat16 if ctx.cuda else torch.float32,
                               requires_grad=True) for h in (4, 1, 1))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
        with profile(activities=activities) as prof:
            module(q, k, v, None).sum().backward()
        ran = sorted({e.name.removeprefix("aten::_scaled_dot_product_") for e in prof.events()
                      if e.name.startswith("aten::_scaled_dot_product") and "backward" not in e.name})
        figures[f"measured_hd{d}_{s // 1024}K"] = f"{fastest}: ran {','.join(ran)}"
        ok &= any(name.startswith(fastest) for name in ran)
    if not rows:
        figures["measured"] = "no row of sdpa_table.py for this GPU: the order from before the table"
    return ok


def lower_right_case(ctx):
    """Context parallelism's per-chunk attention (``SDPAAttention.causal_lower_right``): on CUDA in
    bf16 the aten flash op with no mask, elsewhere a dense mask; both against fp32 math, with GQA."""
    exact_fp32()
    b, lq, lk, hq, hkv, d = (2, 32, 128, 4, 2, 16) if ctx.dry_run else (2, 1024, 4096, 8, 2, 128)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(b, n, h, d, generator=gen) for n, h in ((lq, hq), (lk, hkv), (lk, hkv))]
    grad = torch.randn(b, lq, hq, d, generator=gen)
    lower_right = torch.ones(lq, lk, dtype=torch.bool, device=ctx.device).tril(lk - lq)
    module = build_attention("sdpa")
    figures, ok = {}, True
    for dtype in bf16_fp32:
        q, k, v = (t.to(ctx.device, dtype).requires_grad_() for t in base)
        g = grad.to(ctx.device, dtype)
        ref = _reference(q, k, v, g, lower_right)
        out = module.causal_lower_right(q, k, v)
        out.backward(g)
        err = max(rel_err(x, r) for x, r in zip((out, q.grad, k.grad, v.grad), ref))
        figures[f"{str(dtype).removeprefix('torch.')}_err"] = err
        ok &= err < TOL[dtype]
    # what the wrong alignment looks like: the causal diagonal top-left (sdpa's is_causal)
    bug = rel_err(_reference(q, k, v, g, lower_right.new_ones(lq, lk).tril())[0], ref[0])
    figures["bug_err"] = bug
    ok &= bug > 10 * max(TOL.values())
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": f"q [{b}, {lq}, {hq}, {d}] against a {lk}-key prefix ({hkv} kv heads), fwd+bwd vs fp32 math; "
                      f"bf16 < {TOL[torch.bfloat16]:g} (on CUDA the aten flash op, no mask), "
                      f"fp32 < {TOL[torch.float32]:g} (dense mask); a top-left diagonal gives bug_err"}


# ---- the memory switches on CUDA -------------------------------------------------------------

def _one_step(ctx, args, tokens, ac_mode: str, compile_: bool = False, compute=None):
    """Loss, gradients and peak memory (MiB) of one forward/backward of a fresh, seeded model."""
    from model_harness import clean_name

    from titan_ulysses.distributed.activation_checkpoint import apply_ac
    from titan_ulysses.distributed.activation_offload import apply_activation_offload
    from titan_ulysses.distributed.compile import apply_compile
    from titan_ulysses.models.decoder.model import Transformer

    torch.manual_seed(0)
    model = Transformer(args, compute)
    model.init_weights()
    model.to(ctx.device)
    apply_ac(model, ac_mode)  # the order of parallelize_decoder
    if compile_:
        apply_compile(model)
    if ac_mode == "full_offload":
        apply_activation_offload(model)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    loss = model(tokens, labels=tokens) / tokens.numel()
    loss.backward()
    peak = torch.cuda.max_memory_allocated() / 2**20 if ctx.cuda else 0.0
    grads = {clean_name(n): p.grad for n, p in model.named_parameters()}
    return loss.item(), grads, peak


def _step_errors(a, b) -> tuple[float, float]:
    """(relative loss error, largest relative gradient error) of step ``a`` against ``b``."""
    (la, ga, _), (lb, gb, _) = a, b
    assert ga.keys() == gb.keys(), sorted(set(ga) ^ set(gb))
    return abs(la - lb) / abs(lb), max(rel_err(ga[n], gb[n]) for n in gb)


def full_offload_equals_full(ctx):
    from model_harness import small_args

    exact_fp32()
    s = 128 if ctx.dry_run else 8192
    args = small_args(dim=512 if ctx.cuda else 64, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden_dim=1024)
    tokens = torch.randint(0, args.vocab_size, (1, s), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    full, offload = _one_step(ctx, args, tokens, "full"), _one_step(ctx, args, tokens, "full_offload")
    loss_err, grad_err = _step_errors(offload, full)
    ok = loss_err < 1e-6 and grad_err < 1e-5
    return {"status": "pass" if ok else "fail",
            "figures": {"loss_err": loss_err, "grad_err": grad_err, "peak_mib_full": full[2],
                        "peak_mib_offload": offload[2]},
            "detail": f"4-layer fp32 model, S={s}, block inputs to pinned host memory on the side stream; "
                      "tolerance loss 1e-6, grads 1e-5 (rel.)"}


def compile_one_step(ctx, modes=("none", "selective", "full", "full_offload")):
    """Per-block torch.compile(fullgraph) on CUDA against eager, one step, each AC mode of ``modes``.

    One forward/backward from the same weights, so roundoff is not amplified by an optimizer
    (what the 8-step trainer runs of ``compile_memory_switches`` cannot tell apart from a bug).
    """
    from model_harness import small_args

    from titan_ulysses.models.compute import ComputeOptions

    exact_fp32()
    s = 128 if ctx.dry_run else 4096
    args = small_args(dim=512 if ctx.cuda else 64, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden_dim=1024)
    compute = ComputeOptions(loss_chunk_size=s // 4, mlp_tile_size=s // 4)
    tokens = torch.randint(0, args.vocab_size, (2, s), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    figures = {}
    modes = modes[-2:] if ctx.dry_run else modes
    for mode in modes:  # (the dry run: two of them, each compile costs CI seconds)
        torch._dynamo.reset()
        loss_err, grad_err = _step_errors(_one_step(ctx, args, tokens, mode, compile_=True, compute=compute),
                                          _one_step(ctx, args, tokens, mode, compute=compute))
        figures[f"{mode}_loss_err"], figures[f"{mode}_grad_err"] = loss_err, grad_err
    ok = all(v < 1e-5 for k, v in figures.items() if k.endswith("loss_err")) and \
        all(v < 1e-4 for k, v in figures.items() if k.endswith("grad_err"))
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": f"2-layer fp32 model (dim {args.dim}), 2 x {s} tokens, chunked loss and tiled MLP, TF32 off; "
                      f"compiled blocks vs eager for AC {'/'.join(modes)}, one step from the same "
                      "weights; tolerance loss 1e-5, grads 1e-4 (rel.)"}


def compile_one_step_modes(modes: tuple):
    """``compile_one_step`` for these AC modes only (the short first part)."""
    return lambda ctx: compile_one_step(ctx, modes)


CASES = [
    Case("attn_sdpa_flash", attention_case("sdpa", SDPBackend.FLASH_ATTENTION, False, (torch.bfloat16,)), 10, 5),
    Case("attn_sdpa_cudnn", attention_case("sdpa", SDPBackend.CUDNN_ATTENTION, False, (torch.bfloat16,)), 10, 1),
    Case("attn_sdpa_efficient", attention_case("sdpa", SDPBackend.EFFICIENT_ATTENTION, False, (torch.float32,)), 10, 1),
    Case("attn_sdpa_docmask", attention_case("sdpa", None, True, bf16_fp32), 10, 5),
    Case("attn_flex_causal", attention_case("flex", None, False, bf16_fp32), 60, 10),
    Case("attn_flex_docmask", attention_case("flex", None, True, bf16_fp32), 60, 10),
    Case("attn_flash_attn_pkg", attention_case("flash_attn", None, False, (torch.bfloat16,)), 10, 1),
    Case("attn_sdpa_lower_right_cp", lower_right_case, 10, 2),
    Case("attn_sdpa_priority_auto", sdpa_priority_case, 15, 2),
    *ATTENTION_CASES,
    Case("multiprocess_one_gpu", multiprocess_one_gpu, 90, 30),
    Case("hf_llama_ulysses_bf16", hf_llama_ulysses_bf16, 30, 5),
    Case("loss_fused_bf16", loss_fused_bf16, 20, 2),  # issue 47: the fused loss's CUDA path against fp64
    Case("hf_sft_ulysses_bf16", hf_sft_ulysses_bf16, 90, 60),
    Case("full_offload_equals_full", full_offload_equals_full, 15, 5),
    Case("checkpoint_async_pinned_resume", checkpoint_async_pinned_resume, 60, 30),
    Case("float8_tensorwise", float8_case("tensorwise"), 80, 30),
    Case("float8_rowwise", float8_case("rowwise"), 80, 30),
    Case("compile_one_step", compile_one_step, 90, 40),
    Case("compile_memory_switches", compile_memory_switches, 120, 60),
    Case("trainer_1b_sp1", trainer_1b, 60, 15),
]
