"""Bench and limits cases of the GPU suite (``gpu_suite.py --part bench`` / ``--part limits``).

Bench: local attention against the matmul rate measured in the same run, and training
steps (train.py in a subprocess, warm-up steps dropped, medians) of Llama-3-8B at 128K as
a simulated rank of sp=8 (fake process group: real memory and compute, no data moved)
and of the 1B shape at 32K on one GPU.

Limits: the memory estimate against measured peaks at three lengths, and the longest
sequence of the 1B shape on one GPU and of Llama-3-8B on a simulated rank of 8. A full
step at a million tokens takes minutes (attention is quadratic), more than a GPU session
can spend on one point, so the longest length is found from measured peaks: one step of
the real model cut to 1 and 2 layers (every layer adds the same: its saved block input,
its parameter, gradient and optimizer shards), at two lengths (activations grow linearly
with the length under FlashAttention), then extrapolated to every layer and solved for
the device's memory. The report says so; it is a measurement of the terms, not a run
of the whole model at the limit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.gpu_common import CONFIGS, ROOT, Case, Skip, tagged_json, train
# Synthetic passkey rows are not packed, so sdpa (cuDNN / flash kernels) needs no document
# mask; the GPU configs default to flex for packed text. The 2026-11-23 figures used sdpa.
SYNTHETIC = ["--training.dataset", "passkey", "--model.tokenizer", "byte", "--metrics.enable_tensorboard", "false",
             "--model.attn_backend", "sdpa"]
SIM8 = ["--comm.mode", "fake", "--comm.fake_world_size", "8", "--parallelism.ulysses_degree", "8"]
# llama3_8b_128k.toml ships 4 head stages since issue 44 (the planner's pick on 80 GB): its cells keep the one-stage
# step they have measured since 2026-11-23 (a cell's own extra, after this, sets its stages)
SIM8_ONE_STAGE = [*SIM8, "--parallelism.ulysses_head_stages", "1"]
LONG = ["--activation_checkpoint.mode", "full_offload", "--model.mlp_tile_size", "8192",
        "--model.loss_chunk_size", "2048"]


# ---- bench ---------------------------------------------------------------------------------

def bench_attention_case(ctx):
    import bench_attention  # scripts/bench_attention.py: the runner's own folder is first on the path

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.json")
        argv = ["--json", path] + (["--seq-lens", "64,128", "--head-dim", "16", "--iters", "1", "--warmup", "1"]
                                   if ctx.dry_run else ["--iters", "3", "--warmup", "1", "--head-dims", "128,64,80,96,256",
                                                        "--table"])
        bench_attention.main(argv)
        with open(path) as f:
            rows = json.load(f)
    if not rows:
        return {"status": "fail", "detail": "no backend produced a figure"}
    figures = {f"{r['backend']}@hd{r['head_dim']}@" + (f"{r['seq_len'] // 1024}K" if r["seq_len"] >= 1024 else
                                                     str(r["seq_len"])): round(100 * r["fraction_of_matmul"], 1)
               for r in rows}
    long = [r for r in rows if r["seq_len"] >= 32768 and r["head_dim"] == 128]
    best = max((r["fraction_of_matmul"] for r in long), default=None)
    verdict = "" if best is None else f"; best at 32K+: {100 * best:.0f}% (target 50%: {'met' if best >= 0.5 else 'not met'})"
    return {"status": "measured", "figures": {"matmul_tflops": rows[0]["matmul_tflops"], **figures},
            "detail": "% of the measured matmul rate, causal fwd+bwd, 4 q heads / 1 kv head, head_dim 128 (and 64, 80, "
                      "96, 256: the rows for ops/attention/sdpa_table.py are in the log)" + verdict}


def bench_packed_case(ctx):
    """Tokens/s of one attention call (fwd+bwd, bf16) at 128K tokens per backend: packed documents
    (~16 of random length) against one document per window -- what packing costs or saves."""
    from titan_ulysses.ops.attention import BACKENDS, build_attention, build_attention_mask

    s, hq, hkv, d = (256, 4, 1, 16) if ctx.dry_run else (131072, 4, 1, 128)  # the 8B's heads at sp 8
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(1, s, h, d, generator=gen).to(ctx.device, dtype) for h in (hq, hkv, hkv)]
    starts = torch.rand(1, s, generator=gen) < 16 / s
    starts[:, 0] = True
    docs = starts.long().cumsum(1).to(ctx.device)
    figures, skipped = {}, []
    for name, backend in BACKENDS.items():
        if (backend.cuda_only and not ctx.cuda) or (not ctx.cuda and not backend.cpu_backward):
            skipped.append(name)
            continue
        try:
            module = build_attention(name)
        except ImportError:
            skipped.append(name)
            continue
        for kind, ids in (("packed", docs), ("one_doc", None)):
            q, k, v = (t.clone().requires_grad_() for t in base)
            times = []
            for _ in range(1 if ctx.dry_run else 4):  # the first (compile, mask) dropped on the GPU
                if ctx.cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = module(q, k, v, build_attention_mask(name, ids))
                out.backward(torch.ones_like(out))
                if ctx.cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            figures[f"{name}_{kind}_tok_s"] = round(s / min(times[1:] or times))
    return {"status": "measured", "figures": figures,
            "detail": f"one attention call fwd+bwd, [1, {s}, {hq}/{hkv} heads, {d}] {str(dtype).removeprefix('torch.')}, "
                      f"~16 packed documents (mask built per call) vs one document; best of 3 after a warm-up"
                      + (f"; not run: {', '.join(skipped)}" if skipped else "")}


def train_cell(config: str, compile_on: bool, precision: str, ac: str, extra: list[str], seq_len: int,
               steps: tuple[int, int] = (7, 3)):
    """One bench cell: train.py for ``steps[0]`` steps, the first ``steps[1]`` dropped, medians."""
    def run(ctx):
        if precision == "float8":
            if ctx.cuda and torch.cuda.get_device_capability() < (8, 9):
                raise Skip("float8 matmuls need sm_89+")
            try:
                import torchao  # noqa: F401
            except ImportError:
                raise Skip("torchao is not installed (carry it: scripts/gpu_wheels.sh)")
        n_steps, warmup = (3, 1) if ctx.dry_run else steps
        overrides = ["--training.steps", str(n_steps), "--activation_checkpoint.mode", ac,
                     "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "-1",
                     "--training.local_batch_size", "1", *SYNTHETIC]
        if ctx.dry_run:  # the cell's plumbing at toy size; compile is covered by the correctness part
            overrides += ["--config", os.path.join(CONFIGS, "debug_model.toml"), "--training.seq_len", "128",
                          "--comm.mode", "fake", "--comm.fake_world_size", "2", "--parallelism.ulysses_degree", "2",
                          "--compile.enable", "false"]
        else:
            overrides += [*extra, "--training.seq_len", str(seq_len), "--compile.enable", str(compile_on).lower()]
        if precision == "float8":
            overrides += ["--float8.enable", "true"] + (["--float8.emulate", "true"] if ctx.dry_run else [])
        with tempfile.TemporaryDirectory() as d:
            code, rows, tail = train(ctx, overrides, d, config=config, timeout=400)
        timed = [r for r in rows if r["step"] > warmup]
        if code and "the predicted peak of this layout" in tail:  # the launch refused it before building the model
            return {"status": "skipped", "detail": f"refused at launch (planning/oom.py): {tail[-300:]}"}
        if code or not timed:
            status = "fail" if "out of memory" not in tail.lower() else "measured"
            return {"status": status, "detail": f"exit {code}: {'OOM' if status == 'measured' else tail[-300:]}"}
        tps = statistics.median(r["tokens_per_sec_per_device"] for r in timed)
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        world = 2 if ctx.dry_run else (8 if "--comm.fake_world_size" in extra else 1)
        figures = {"tok_s_per_dev": tps, "mfu_pct": statistics.median(mfus) if mfus else None,
                   "peak_gib": max(r["max_memory_gib"] for r in rows),  # reserved (max_memory_reserved)
                   "peak_allocated_gib": max((r["max_memory_allocated_gib"] for r in rows
                                              if "max_memory_allocated_gib" in r), default=None),
                   "step_s": (128 if ctx.dry_run else seq_len) / (tps * world),
                   "a2a_model_s": rows[-1].get("a2a_model_sec")}
        return {"status": "measured", "figures": figures,
                "detail": f"{n_steps} steps, first {warmup} dropped, medians, local batch 1; a2a_model_s: the "
                          f"modelled all-to-all time of a real sp=8 step at comm.link_bandwidth_gbps (not in step_s)"}

    return run


# ---- limits ----------------------------------------------------------------------------------

def estimate_validate(seq_len: int):
    def run(ctx):
        cfg = os.path.join(CONFIGS, "debug_model.toml" if ctx.dry_run else "llama3_8b_128k.toml")
        world = 1 if ctx.dry_run else 8
        argv = [sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--config", cfg,
                "--world-size", str(world), "--validate", "--json", *SYNTHETIC, "--training.global_batch_size", "-1",
                "--parallelism.ulysses_head_stages", "1",
                "--compile.enable", "false"]
        if ctx.dry_run:
            argv += ["--parallelism.ulysses_degree", "1", "--training.seq_len", "128", "--activation_checkpoint.mode",
                     "full"]
        else:
            argv += ["--training.seq_len", str(seq_len), "--device-memory-gib",
                     f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}", "--track"]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=ctx.timeout(240))
        if proc.returncode:
            return {"status": "fail", "detail": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"}
        out = "\n" + proc.stdout  # on CUDA the trainer prints its start-up line first
        result = json.loads(out[out.rindex("\n{") + 1:])
        v, tracked = result["validation"], result.get("tracked")
        err = v["error_pct"]
        figures = {"estimated_gib": v["estimated"] / 2**30, "measured_gib": v["measured"] / 2**30, "error_pct": err}
        if tracked:  # the CPU tracker's peak of the same step: what CUDA adds beyond PyTorch's tensors
            figures["tracked_gib"] = tracked["measured"] / 2**30
        return {"status": "pass" if abs(err) <= 15 else "fail",
                "figures": figures,
                "detail": f"{v['what']}; {'debug model' if ctx.dry_run else 'Llama-3-8B, simulated rank of sp=8, AC full'}, "
                          f"seq_len {128 if ctx.dry_run else seq_len}; target: within 15%"}

    return run


def trial_main(spec: dict) -> int:
    """One memory trial in its own process: the model cut to ``n_layers``, a warm-up step on a
    short batch (optimizer state allocated), then one step at ``seq_len``; prints one JSON line."""
    import dataclasses

    import titan_ulysses.preflight as preflight_mod
    import titan_ulysses.trainer as trainer_mod
    from titan_ulysses.config.manager import load_config

    original = preflight_mod.resolve_run  # the run's spec, the model cut to n_layers (every builder reads it)

    def cut(*args, **kwargs):
        run = original(*args, **kwargs)
        return dataclasses.replace(run, args=dataclasses.replace(run.args, n_layers=spec["n_layers"]))

    preflight_mod.resolve_run = cut
    config = load_config(["--config", spec["config"], *spec["overrides"], "--training.seq_len", str(spec["seq_len"]),
                          "--checkpoint.enable", "false",
                          "--training.allow_over_memory_estimate", "true"])  # a trial measures past the estimate
    t = trainer_mod.Trainer(config)
    cuda = t.device.type == "cuda"

    def batch(s: int):
        g = torch.Generator().manual_seed(s)
        tokens = torch.randint(0, 256, (1, s + 1), generator=g)
        return {"input": tokens[:, :-1], "labels": tokens[:, 1:], "positions": torch.arange(s)[None],
                "document_ids": torch.zeros(1, s, dtype=torch.long)}

    def steps(s: int):  # the trainer takes steps: StepData (microbatches and counts, on the device)
        return iter([t.batches.next(iter([batch(s)]))])

    t.train_step(steps(spec["warm_len"]))
    if cuda:  # what the warm-up left cached would otherwise hide the step's own peak
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        t.train_step(steps(spec["seq_len"]))
        if cuda:
            torch.cuda.synchronize()
        out = {"peak_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
               "peak_reserved": torch.cuda.max_memory_reserved() if cuda else 0,
               "step_s": time.perf_counter() - start}
    except torch.OutOfMemoryError:
        out = {"oom": True}
    print("TRIAL " + json.dumps(out), flush=True)
    return 0


def run_trial(ctx, config: str, overrides: list[str], n_layers: int, seq_len: int, warm_len: int) -> dict:
    """One ``--trial`` subprocess (``trial_main``): the first ``n_layers`` of ``config`` at ``seq_len``, after a
    warm-up at ``warm_len``; its TRIAL line as a dict, ``{"error": ...}`` when it printed none."""
    spec = {"config": config, "overrides": overrides, "n_layers": n_layers, "seq_len": seq_len, "warm_len": warm_len}
    argv = [sys.executable, os.path.join(ROOT, "scripts", "gpu_suite.py"), "--trial", json.dumps(spec)]
    out, why = tagged_json(argv, "TRIAL", ctx.timeout(400))
    return out if out is not None else {"error": why[-300:]}


def longest(config_name: str, extra: list[str], lengths: tuple[int, int], target: int, what: str):
    def run(ctx):
        from titan_ulysses.config.manager import load_config
        from titan_ulysses.models.resolve import model_args

        if ctx.dry_run:
            config, lengths_, warm = os.path.join(CONFIGS, "debug_model.toml"), (128, 256), 64
            overrides = [*SYNTHETIC, "--parallelism.ulysses_degree", "1", "--activation_checkpoint.mode", "full",
                         "--training.global_batch_size", "-1", "--training.local_batch_size", "1"]
        else:
            config, lengths_, warm = os.path.join(CONFIGS, config_name), lengths, 8192
            overrides = [*SYNTHETIC, *LONG, *extra, "--training.global_batch_size", "-1",
                         "--training.local_batch_size", "1", "--compile.enable", "false"]
        loaded = load_config(["--config", config, *overrides])
        n_layers = model_args(loaded, 0).n_layers
        # groups of k checkpointed layers (activation_checkpoint.layers_per_checkpoint) repeat every k
        # layers: measure one and two groups
        k = loaded.activation_checkpoint.layers_per_checkpoint
        peaks, steps = {}, {}
        for s in lengths_:
            for layers in (k, 2 * k):
                r = run_trial(ctx, config, overrides, layers, s, warm)
                so_far = {f"peak_gib_{key[0] // 1024}K_{key[1]}L": v / 2**30 for key, v in peaks.items()}
                if "error" in r:
                    return {"status": "fail", "figures": so_far, "detail": f"trial {layers} layer(s) at {s}: {r['error']}"}
                if r.get("oom"):
                    return {"status": "measured", "figures": so_far,
                            "detail": f"out of memory with {layers} layer(s) at {s} tokens"}
                peaks[(s, layers)] = r["peak_allocated"] if ctx.cuda else 1.0 * layers * s
                steps[(s, layers)] = r["step_s"]
        # peak(S, L) = a(S) + (L / k - 1) * b(S), with a and b linear in S
        full = {s: peaks[(s, k)] + (n_layers / k - 1) * (peaks[(s, 2 * k)] - peaks[(s, k)]) for s in lengths_}
        s0, s1 = lengths_
        slope = (full[s1] - full[s0]) / (s1 - s0)
        device = torch.cuda.get_device_properties(0).total_memory if ctx.cuda else 64 * 2**30
        usable = device - 4 * 2**30  # CUDA context, NCCL buffers and fragmentation beside the peak
        best = int(s1 + (usable - full[s1]) / slope) if slope > 0 else None
        gib = 2**30
        figures = {f"peak_gib_{s // 1024}K_{n_layers}L": full[s] / gib for s in lengths_}
        figures.update({f"step_s_{s // 1024}K_{2 * k}L": steps[(s, 2 * k)] for s in lengths_})
        figures["longest_tokens"] = best
        met = best is not None and best >= target
        return {"status": "measured", "figures": figures,
                "detail": f"{what}: peaks (allocated) measured with {k} and {2 * k} layers at {lengths_[0]} and {lengths_[1]} "
                          f"tokens, extrapolated to {n_layers} layers and to {usable / gib:.0f} GiB; target {target}: "
                          f"{'met' if met else 'not met'} by this extrapolation"}

    return run


def cell_steps(compile_on: bool, precision: str, ac: str, extra: tuple = ()):
    """The 8B 128K cell on a simulated rank of sp=8 in fewer steps (the short parts: 5 and 2 compiled, 4 and 1 eager)."""
    return train_cell(os.path.join(CONFIGS, "llama3_8b_128k.toml"), compile_on, precision, ac, [*SIM8_ONE_STAGE, *extra],
                      128 * 1024, steps=(5, 2) if compile_on else (4, 1))


def _lazy(module: str, name: str):
    """A case function of another benchmarks module, imported when it runs (those modules import this one)."""
    def run(ctx):
        import importlib

        return getattr(importlib.import_module(f"benchmarks.{module}"), name)(ctx)

    return run


K = 1024
BENCH_CASES = [
    Case("bench_attention", bench_attention_case, 120, 10),
    Case("bench_packed_128k", bench_packed_case, 150, 5),
    Case("bench_rates", _lazy("planner_cases", "bench_rates"), 60, 5),  # planning/rates.py's figures
    Case("profile_8b_stages", _lazy("planner_cases", "profile_8b_stages"), 110, 15),  # why stages are faster
    Case("8b_128k_sim8_compile_bf16_full_offload_snapshot", _lazy("offload_case", "offload_vs_full_snapshot"), 80, 10),
    # issue 45: the transformers integration's memory options, peak per token on CUDA (scripts/bench_hf_memory.py)
    Case("hf_memory_bf16", _lazy("hf_memory_case", "hf_memory_bf16"), 120, 25),
    *[Case(f"8b_128k_sim8_{'compile' if c else 'eager'}_{p}_{ac}",
           train_cell(os.path.join(CONFIGS, "llama3_8b_128k.toml"), c, p, ac, SIM8_ONE_STAGE, 128 * K), 110, 10)
      for c, p, ac in ((True, "bf16", "selective"), (True, "float8", "selective"), (True, "bf16", "full"),
                       (True, "float8", "full"), (True, "bf16", "full_offload"))],
    # the same step with PyTorch's SDPA order (FlashAttention first) instead of "auto" (cuDNN first on Hopper)
    Case("8b_128k_sim8_compile_bf16_selective_sdpa_flash",
         train_cell(os.path.join(CONFIGS, "llama3_8b_128k.toml"), True, "bf16", "selective",
                    [*SIM8_ONE_STAGE, "--model.sdpa_backends", "flash"], 128 * K), 110, 10),
    # head-staged Ulysses against the full-AC cell above (same step, 4 stages): the stages' cost
    Case("8b_128k_sim8_compile_bf16_full_stages4",
         train_cell(os.path.join(CONFIGS, "llama3_8b_128k.toml"), True, "bf16", "full",
                    [*SIM8_ONE_STAGE, "--parallelism.ulysses_head_stages", "4"], 128 * K), 110, 10),
    *[Case(f"1b_32k_{'compile' if c else 'eager'}_{p}_{ac}",
           train_cell(os.path.join(CONFIGS, "llama3_1b_long.toml"), c, p, ac,
                      ["--parallelism.ulysses_degree", "1"], 32 * K), 60, 10)
      for c, p, ac in ((True, "bf16", "selective"), (True, "float8", "selective"), (False, "bf16", "selective"))],
]
# longest_1b_one_gpu: four trials (1 and 2 layers at 512K and 1M tokens) of about 16/33/65/130 s
# of attention alone at FlashAttention's measured rate, plus four process starts; the first GPU
# session ran out of budget in its last trial with 130 s allowed
LIMIT_CASES = [
    *[Case(f"estimate_validate_8b_{s // K}k", estimate_validate(s), 20, 10) for s in (32 * K, 64 * K, 128 * K)],
    Case("longest_1b_one_gpu", longest("llama3_1b_long.toml", ["--parallelism.ulysses_degree", "1"],
                                       (512 * K, 1024 * K), 1024 * K, "1B shape, one GPU, full_offload"), 300, 20),
    Case("longest_8b_sim_rank8", longest("llama3_8b_128k.toml", SIM8_ONE_STAGE, (512 * K, 1024 * K), 3_700_000,
                                         "Llama-3-8B, simulated rank of sp=8, full_offload"), 120, 20),
    # the head-staged configs' tracked estimates (docs/benchmarks.md), measured the same way; each
    # trial's attention grows with the square of the length (the 2M one: about a minute per layer
    # on an H100 by the 128K cell's rate, with the stages' recompute), four trials each
    Case("longest_8b_6m_sim_rank8_stages4", longest("llama3_8b_6m.toml", SIM8, (1024 * K, 2048 * K), 6_000_000,
                                                    "Llama-3-8B, simulated rank of sp=8, 4 head stages"), 360, 20),
    Case("longest_1b_2m_one_gpu_stages8", longest("llama3_1b_2m_one_gpu.toml", [], (512 * K, 1024 * K), 2_000_000,
                                                  "1B shape, one GPU, 8 head stages, CPU offload"), 300, 20),
    # checkpoint groups of 4 layers: trials of 4 and 8 layers, so shorter lengths than the others
    Case("longest_8b_1m_one_gpu_stages8", longest("llama3_8b_1m_one_h200.toml", [], (128 * K, 256 * K), 1_200_000,
                                                  "Llama-3-8B, one GPU (H200), 8 head stages, CPU offload, "
                                                  "checkpoint groups of 4 layers"), 300, 20),
]
