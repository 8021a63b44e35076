"""Scope a job before launching it: a model, a target sequence length and the GPUs in, a TOML
to start from, the memory per device by phase, and an estimated throughput out.

    python scripts/plan.py (--flavor 8B | --hf-assets-path DIR) --seq-len 131072 --gpus 8 \\
        [--gpu-memory-gib 80] [--out plan.toml]

The same pre-flight as a launch runs first (``preflight.validate`` and ``check_files``): a model
folder or setting the trainer refuses is refused here, in the same line. The layout and memory
switches are the first that fit 90% of the device by the memory
estimate (``planning/estimate.py``, ``planning/recommend.recommend``: the same search as
``scripts/estimate_memory.py``). The throughput is an ESTIMATE: the step's FLOPs
(``metrics/flops.py``, plus the forward recomputed under activation checkpointing) at the
kernel rates measured in docs/benchmarks.md (bf16 matmul and cuDNN attention on an H200),
with communication, the optimizer and every other kernel left out: an upper bound. The
measured compiled Llama-3-8B 128K step (docs/benchmarks.md) reached 3673 tokens/s per device.

The layout is the fewest ranks per sequence that fit (memory only): for Llama-3-8B at 128K on 8
GPUs of 80 GiB that is ``ulysses_degree 1`` (dp_shard 8) with full AC and a tiled MLP, at 59 GiB.
``train_configs/llama3_8b_128k.toml`` ships sp=8 instead (32 GiB): the headroom buys selective AC
(no recomputed forward), a global batch of one sequence, and sequences to about 900K tokens.
docs/parallelism.md, "When sp wins", has the figures.
"""

from __future__ import annotations

import argparse
import math
import sys

from titan_ulysses.models.registry import num_params
from titan_ulysses.runs.outputs import output_problem, write_text

# docs/benchmarks.md, "local attention at 32K+": bf16 matmul 787 TFLOP/s, cuDNN SDPA 74% of it at
# 32K and 70% at 64K and 128K (H200, gpu_suite.py --part bench, bench_attention)
MATMUL_TFLOPS = 787.0
ATTENTION_FRACTION = {32768: 0.74, 65536: 0.70}  # longest sequence length -> measured fraction
RECOMPUTE = {"none": 0.0, "selective": 0.0, "full": 1.0, "full_offload": 1.0}  # forwards run again (of 3)


def attention_fraction(seq_len: int) -> float:
    """The measured cuDNN fraction at the nearest measured length at or below ``seq_len`` (32K's below it)."""
    return min(ATTENTION_FRACTION.items(), key=lambda kv: (kv[0] > seq_len, -kv[0]))[1]


def tokens_per_second(args, seq_len: int, ac_mode: str, matmul_tflops: float) -> dict:
    """Compute-bound tokens/s per device: the step's matmul and attention FLOPs at the measured rates."""
    from titan_ulysses.metrics.flops import flops_per_token

    total = flops_per_token(args, seq_len)
    attention = 3 * 4 * args.n_layers * args.n_heads * args.head_dim * seq_len / 2  # as flops.py counts it
    matmul = total - attention
    factor = 1 + RECOMPUTE[ac_mode] / 3  # forward = 1/3 of forward + backward
    frac = attention_fraction(seq_len)
    seconds = factor * (matmul / (matmul_tflops * 1e12) + attention / (frac * matmul_tflops * 1e12))
    return {"tokens_per_sec_per_device": 1 / seconds, "flops_per_token": total * factor,
            "attention_share": attention / total, "matmul_tflops": matmul_tflops, "attention_fraction": frac}


def plan_config(a):
    """The JobConfig of the plan, its layout and the memory estimate, or SystemExit naming why not."""
    from titan_ulysses.config.manager import ConfigError, _set, load_config
    from titan_ulysses.data.sources import DataError
    from titan_ulysses.preflight import check_files, validate
    from titan_ulysses.run_spec import resolve_run
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import GIB, from_config
    from titan_ulysses.planning.recommend import BUDGET, recommend

    base = ["--training.seq_len", str(a.seq_len), "--training.local_batch_size", "1",
            "--training.mixed_precision_param", "bfloat16", "--parallelism.ulysses_degree", "1",
            "--compile.enable", "true"]
    base += ["--model.hf_assets_path", a.hf_assets_path, "--model.tokenizer", "hf"] if a.hf_assets_path else [
        "--model.flavor", a.flavor]
    try:
        config = load_config(base)
        spec = resolve_run(config, tokenizer=False)  # the model as train.py resolves it
        dims = validate(config, a.gpus, spec)  # the trainer's pre-flight: what it refuses is not planned for
        spec = check_files(config, spec)  # the files, then the tokenizer against the model
        args, layout, switches = from_config(config, dims, spec.args)
        rec = recommend(args, layout, switches, a.seq_len, 1, a.gpus, BUDGET * a.gpu_memory_gib * GIB)
        if rec is None:
            raise SystemExit(f"plan: no layout of {a.gpus} GPUs and no memory switch fits seq_len {a.seq_len} in "
                             f"{BUDGET:.0%} of {a.gpu_memory_gib:g} GiB; more GPUs, more memory or a shorter length")
        for flag in rec[1]:
            key, value = flag.split()
            _set(config, key[2:], value, from_cli=True)
        dims = validate(config, a.gpus, spec)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"plan: {e}") from e
    args, layout, switches = from_config(config, dims, spec.args)
    return config, dims, args, estimate(args, layout, switches, a.seq_len, 1), rec[1]


def to_toml(config, overrides: list[str], note: str) -> str:
    """The settings that differ from the defaults, as TOML sections."""
    import dataclasses

    from titan_ulysses.config.job_config import JobConfig

    default = JobConfig()
    lines = [f"# {note}"]
    for section in dataclasses.fields(config):
        ours, theirs = getattr(config, section.name), getattr(default, section.name)
        changed = [(f.name, getattr(ours, f.name)) for f in dataclasses.fields(ours)
                   if getattr(ours, f.name) != getattr(theirs, f.name)]
        if section.name == "job":
            changed = [("dump_folder", "./outputs/plan")] + [c for c in changed if c[0] != "dump_folder"]
        if section.name == "parallelism":  # the layout, always spelled out
            changed = [(f.name, getattr(ours, f.name)) for f in dataclasses.fields(ours)]
        if not changed:
            continue
        lines.append(f"\n[{section.name}]")
        for name, value in changed:
            text = ("true" if value else "false") if isinstance(value, bool) else (
                f'"{value}"' if isinstance(value, str) else repr(value))
            lines.append(f"{name} = {text}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--flavor", help="a named size: debugmodel, 1B, 3B, 8B, 70B")
    model.add_argument("--hf-assets-path", help="a Hugging Face model folder (its config.json) or a Hub id (org/name)")
    p.add_argument("--seq-len", type=int, required=True, help="target training.seq_len")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (H100: 80, H200: 141)")
    p.add_argument("--matmul-tflops", type=float, default=MATMUL_TFLOPS,
                   help=f"bf16 matmul rate of the GPU (default {MATMUL_TFLOPS:g}: measured on an H200)")
    p.add_argument("--device-name", default="", help="the GPU whose achieved rates the step-time model takes "
                   "(planning/rates.py: H100, H200; default: the listed one nearest --gpu-memory-gib)")
    p.add_argument("--out", default="", help="also write the TOML here (an existing file only with --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    a = p.parse_args(argv)
    problem = a.out and output_problem("--out", a.out, a.overwrite, folder=False)
    if problem:
        raise SystemExit(f"plan: {problem}")
    for flag, value in (("--seq-len", a.seq_len), ("--gpus", a.gpus), ("--gpu-memory-gib", a.gpu_memory_gib),
                        ("--matmul-tflops", a.matmul_tflops)):
        if not (math.isfinite(value) and value > 0):  # nan > 0 is False, but so is nan <= 0
            raise SystemExit(f"plan: {flag} must be a positive finite number, got {value}")
    from titan_ulysses.planning.inputs import GIB

    config, dims, args, est, overrides = plan_config(a)
    speed = tokens_per_second(args, a.seq_len, config.activation_checkpoint.mode, a.matmul_tflops)
    toml = to_toml(config, overrides, f"scripts/plan.py: {num_params(args) / 1e6:,.0f}M params, seq_len {a.seq_len}, "
                                      f"{a.gpus} GPUs of {a.gpu_memory_gib:g} GiB; set dataset, steps and lr")
    print(toml)
    if a.out:
        write_text(a.out, toml)
        print(f"# written to {a.out}")
    print(f"layout {dims.degrees}; memory per device by phase (estimate; total = the largest):")
    print("  (the fewest ranks per sequence that fit; a larger ulysses_degree leaves room for selective AC, "
          "a smaller global batch and longer sequences: docs/parallelism.md, 'When sp wins')")
    for name, value in est.phases.items():
        print(f"  {name:<24} {value / GIB:8.2f} GiB{'  <- peak' if name == est.peak_phase else ''}")
    print(f"  {'total':<24} {est.total / GIB:8.2f} GiB of {a.gpu_memory_gib:g}")
    print(f"throughput ESTIMATE (compute only, an upper bound): {speed['tokens_per_sec_per_device']:,.0f} tokens/s "
          f"per device, {speed['tokens_per_sec_per_device'] * a.gpus:,.0f} for the job; "
          f"{speed['flops_per_token'] / 1e9:.1f} GFLOP per token ({100 * speed['attention_share']:.0f}% attention) at "
          f"{speed['matmul_tflops']:g} TFLOP/s matmul and {100 * speed['attention_fraction']:.0f}% of it in attention "
          f"(docs/benchmarks.md)")
    print(_timed(a, config, dims, args))
    return 0


def _timed(a, config, dims, args) -> str:
    """The step-time model's prediction for this plan and the fastest switches that fit at its layout."""
    from titan_ulysses.planning.fastest import fastest
    from titan_ulysses.planning.inputs import GIB, from_config
    from titan_ulysses.planning.rates import device_rates, kernel_of
    from titan_ulysses.planning.timing import step_time

    try:
        rates = device_rates(a.device_name or None, a.gpu_memory_gib)
    except ValueError as e:
        raise SystemExit(f"plan: --device-name: {e}") from e
    args, layout, switches = from_config(config, dims, args)
    kernel = kernel_of(config.model.attn_backend)
    t = step_time(args, layout, switches, a.seq_len, rates, 1, True, "bf16", kernel,
                  link_gbs=config.comm.link_bandwidth_gbps)
    best = fastest(args, layout, switches, a.seq_len, 1, rates, a.gpu_memory_gib * GIB, True, False, "bf16", kernel)
    return (f"step-time model (planning/timing.py, {rates.device} rates, {kernel} attention): {t.tok_s:,.0f} tokens/s "
            f"per device, {t.mfu_pct:.1f}% MFU (a prediction); fastest that fits at this layout: "
            + (best.line() if best else "none"))


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
