"""The GPU suite's short parts (``gpu_suite.py --part first`` / ``--part second``): what proves the
most per second of a 15-minute GPU window, and the cases of its own that the long parts lack.

``first`` (planned within 450 s on an H100, wheel install and compile warm-up included):
the kernels ``"auto"`` picks, compile against eager in one step, the pinned-stager save and
resume, packed documents without a dense mask, cp's per-chunk kernel, head stages / LoRA / cp
on ranks sharing the GPU, every family's bf16 logits against transformers, the headline 8B
step with its memory estimate, and one limits point of the head-staged 6M config.
The head stages' cost (the compiled AC-full step, plain and in 4 stages) closes it.
``second`` (within 180 s on a started machine): float8 and ``full_offload`` against the first
part's cells, the 128K packed-documents row. ``rest``: what fits neither.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import torch

from _gpu_common import Case, rel_err
from _runs import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests"))

CONFIGS = os.path.join(ROOT, "train_configs")
OVERHEAD_S = 15  # the wheel install and the suite's own start (imports, CUDA context), before the first case


# ---- ranks sharing the GPU: head stages, LoRA, cp against one process ------------------------

def features_multirank(ctx):
    """Head-staged Ulysses (AC full) and LoRA on gloo ranks sharing the device, each against
    one process on the same device (fp32, AdamW steps, trained-like attention weights)."""
    from _gpu_multirank import model_equality, spawn

    # not cp: its K/V all-gather is a functional collective, which segfaults on gloo with CUDA tensors
    # (torch 2.11; seen on the H200 on 2026-11-26); cp's kernels are the attention cases' here and its
    # layouts test_context_parallel's on CPU
    cases = (("sp2_head_stages2_ac_full", {"sp": 2}, 2, {"ulysses_head_stages": 2, "ac_mode": "full"}, False),
             ("sp2_lora", {"sp": 2}, 2, {}, True))
    figures, notes, ok = {}, [], True
    for name, layout, world, options, lora in cases:
        res = spawn(world, "gloo", ctx.device.type, (model_equality, layout, 2, options, lora), ctx.timeout(150))
        figures[name] = res
        if "error" in res:
            ok = False
            notes.append(f"{name}: {res['error']}")
        else:
            ok &= res["loss"] < 1e-5 and res["grad"] < 1e-4 and res["param"] < 1e-5
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": "; ".join(notes) or "fp32 model (dim 128, 8/2 heads, S=77, wq/wk x4) on gloo ranks sharing the "
                                         "device vs one process, 2 AdamW steps; loss 1e-5, grads 1e-4, params 1e-5 (rel.)"}


# ---- every family's bf16 logits against transformers ------------------------------------------

def families_bf16(ctx):
    """Each family's variants (tests/hf_fixtures.py) at tiny shapes on the device: our bf16 logits
    against transformers' fp32, beside transformers' own bf16 error; our fp32 within 1e-4."""
    from hf_fixtures import FAMILY_VARIANTS, VARIANTS, make_hf_model

    from titan_ulysses.checkpoint.hf import load_hf_weights
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.hf_config import load_hf_args
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


# ---- the headline step with its memory estimate -----------------------------------------------

def _estimate_gib(config_path: str, overrides: list[str], world: int, n_layers: int | None = None) -> dict:
    """The planner's estimate of the same step (``scripts/estimate_memory.py``'s arithmetic, in process)."""
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import from_config
    from titan_ulysses.preflight import validate

    config = load_config(["--config", config_path, *overrides])
    args, layout, switches = from_config(config, validate(config, world))
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers)
    est = estimate(args, layout, switches, config.training.seq_len, config.training.local_batch_size)
    return {"estimate_gib": est.total / 2**30, "estimate_phase": est.peak_phase}


def headline_8b(ctx):
    """Llama-3-8B, 128K, simulated rank of sp=8, compiled bf16, selective AC, cuDNN first ("auto"):
    tokens/s, MFU, peak; and the memory estimate of the same step against its measured peak."""
    from _gpu_perf import SIM8, SYNTHETIC, train_cell

    seq = 128 * 1024
    config = os.path.join(CONFIGS, "llama3_8b_128k.toml")
    row = train_cell(config, True, "bf16", "selective", SIM8, seq, steps=(5, 2))(ctx)
    if row["status"] != "measured" or "figures" not in row:
        return row
    if ctx.dry_run:
        config, overrides, world = os.path.join(CONFIGS, "debug_model.toml"), [
            "--training.seq_len", "128", "--comm.mode", "fake", "--comm.fake_world_size", "2",
            "--parallelism.ulysses_degree", "2"], 1
    else:
        overrides, world = [*SIM8, "--training.seq_len", str(seq)], 1  # fake mode: one process
    est = _estimate_gib(config, [*overrides, *SYNTHETIC, "--activation_checkpoint.mode", "selective",
                                 "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "-1",
                                 "--training.local_batch_size", "1", "--checkpoint.enable", "false"], world)
    peak = row["figures"]["peak_gib"]
    row["figures"].update(est, estimate_err_pct=100 * (est["estimate_gib"] - peak) / peak if ctx.cuda else None)
    row["detail"] += ("; estimate_err_pct: the planner's estimate (it models eager steps) against the step's peak "
                      "(max_memory_gib, reserved), target within 10%")
    return row


# ---- one limits point: the head-staged 6M config cut to 2 layers ------------------------------

def limits_6m_two_layers(ctx):
    """``llama3_8b_6m.toml`` (4 head stages, full_offload, simulated rank of sp=8) cut to 2 layers,
    one step at 1M tokens: measured peak against the estimate of the same 2-layer model."""
    from _gpu_perf import SIM8, SYNTHETIC, _trial

    if ctx.dry_run:
        config, seq, world = os.path.join(CONFIGS, "debug_model.toml"), 256, 1
        overrides = [*SYNTHETIC, "--parallelism.ulysses_degree", "1", "--activation_checkpoint.mode", "full"]
    else:
        config, seq, world = os.path.join(CONFIGS, "llama3_8b_6m.toml"), 1024 * 1024, 1  # fake mode: one process
        overrides = [*SYNTHETIC, *SIM8]
    overrides += ["--training.global_batch_size", "-1", "--training.local_batch_size", "1", "--compile.enable", "false",
                  "--checkpoint.enable", "false"]
    r = _trial(ctx, config, overrides, 2, seq, 64 if ctx.dry_run else 8192)
    if "error" in r:
        return {"status": "fail", "detail": f"trial: {r['error']}"}
    if r.get("oom"):
        return {"status": "fail", "detail": f"out of memory with 2 layers at {seq} tokens"}
    est = _estimate_gib(config, [*overrides, "--training.seq_len", str(seq)], world, n_layers=2)
    measured = r["peak_allocated"] / 2**30
    err = 100 * (est["estimate_gib"] - measured) / measured if measured else None
    figures = {"measured_gib": measured, **est, "error_pct": err, "step_s": r["step_s"]}
    status = "measured" if err is None else "pass" if abs(err) <= 10 else "fail"  # CPU: no device peak
    return {"status": status, "figures": figures,
            "detail": f"2 layers, {seq} tokens over a simulated rank of sp=8, 4 head stages, full_offload, eager; "
                      "peak allocated of the second step vs the estimate, target within 10%"}


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


def _by_name(*lists) -> dict:
    return {c.name: c for cases in lists for c in cases}


def parts() -> dict[str, list[Case]]:
    import _gpu_correctness
    import _gpu_perf

    known = _by_name(_gpu_correctness.CASES, _gpu_perf.BENCH_CASES)
    # estimates: the 2026-11-26 H200 run's seconds (docs/gpu_runs/) with a margin for an H100's slower memory
    first = [
        Case("attn_sdpa_priority_auto", known["attn_sdpa_priority_auto"].fn, 12, 2),
        Case("compile_one_step", _gpu_correctness.compile_one_step_modes(("selective", "full_offload")), 30, 20),
        Case("checkpoint_async_pinned_resume", known["checkpoint_async_pinned_resume"].fn, 45, 30),
        Case("attn_sdpa_docs_window_softcap", known["attn_sdpa_docs_window_softcap"].fn, 5, 3),
        Case("attn_sdpa_lower_right_cp", known["attn_sdpa_lower_right_cp"].fn, 5, 2),
        Case("features_multirank", features_multirank, 30, 40),
        Case("moe_grouped_mm_bf16", moe_grouped_mm, 10, 3),
        Case("families_bf16", families_bf16, 15, 10),
        Case("headline_8b_128k_sim8_compile_bf16_selective", headline_8b, 65, 15),
        Case("limits_6m_staged_two_layers_1m", limits_6m_two_layers, 55, 15),
        Case("attn_flex_docs_window_softcap", known["attn_flex_docs_window_softcap"].fn, 25, 5),
        Case("attn_flash_attn_docs_window_softcap", known["attn_flash_attn_docs_window_softcap"].fn, 5, 1),
        # head stages' cost: the same compiled step with AC full, plain and in 4 stages (found a
        # per-layer recompile on 2026-11-26)
        Case("8b_128k_sim8_compile_bf16_full", _gpu_perf.cell_steps(True, "bf16", "full"), 65, 10),
        Case("8b_128k_sim8_compile_bf16_full_stages4",
             _gpu_perf.cell_steps(True, "bf16", "full", ["--parallelism.ulysses_head_stages", "4"]), 65, 10),
    ]
    second = [  # against the first part's cells on the same started machine
        Case("8b_128k_sim8_compile_float8_selective", _gpu_perf.cell_steps(True, "float8", "selective"), 65, 10),
        Case("8b_128k_sim8_compile_bf16_full_offload", _gpu_perf.cell_steps(True, "bf16", "full_offload"), 65, 10),
        Case("bench_packed_128k", known["bench_packed_128k"].fn, 35, 5),
    ]
    rest = [known["attn_flex_cp4_docs_window_softcap"], known["attn_flash_attn_cp4_docs_window"],
            Case("8b_128k_sim8_eager_bf16_full", _gpu_perf.cell_steps(False, "bf16", "full"), 45, 10),
            Case("8b_128k_sim8_eager_bf16_full_offload", _gpu_perf.cell_steps(False, "bf16", "full_offload"), 45, 10)]
    return {"first": first, "second": second, "rest": rest}


BUDGETS = {"first": 450.0, "second": 180.0, "rest": 500.0}
