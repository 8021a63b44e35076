"""Performance cases of the GPU suite's ``first`` part: the headline step (Llama-3-8B at 128K on a
simulated rank of sp=8, compiled bf16) with its memory estimate, and one limits point of the
head-staged 6M config cut to two layers against its estimate."""

from __future__ import annotations

import dataclasses
import os

from benchmarks.gpu_common import CONFIGS
from benchmarks.gpu_perf import SIM8, SYNTHETIC, run_trial, train_cell


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
    if ctx.dry_run:
        config, seq, world = os.path.join(CONFIGS, "debug_model.toml"), 256, 1
        overrides = [*SYNTHETIC, "--parallelism.ulysses_degree", "1", "--activation_checkpoint.mode", "full"]
    else:
        config, seq, world = os.path.join(CONFIGS, "llama3_8b_6m.toml"), 1024 * 1024, 1  # fake mode: one process
        overrides = [*SYNTHETIC, *SIM8]
    overrides += ["--training.global_batch_size", "-1", "--training.local_batch_size", "1", "--compile.enable", "false",
                  "--checkpoint.enable", "false"]
    r = run_trial(ctx, config, overrides, 2, seq, 64 if ctx.dry_run else 8192)
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
