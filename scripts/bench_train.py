"""Tokens/s per device, MFU and peak memory of training steps over a matrix of settings.

    python scripts/bench_train.py --config train_configs/llama3_1b_long.toml --seq-len 131072
    python scripts/bench_train.py --config train_configs/debug_model.toml --nproc 2 \\
        --compile off --precision fp32 --ac none,full --steps 6 --warmup 2     # CPU smoke run

Each cell of {compile} x {precision} x {AC mode} is one short run of ``train.py`` (its own
process, so memory peaks and compile caches do not leak between cells). The first
``--warmup`` steps are dropped (compilation, allocator warm-up); the table shows medians
of the remaining steps' tokens/s per device and MFU, and the largest peak memory. A
simulated rank of an N-GPU job: add ``--extra "--comm.mode fake --comm.fake_world_size 8
--parallelism.ulysses_degree 8"`` with ``--nproc 1``. float8 on a machine without an
sm_89+ GPU runs emulated (marked ``float8-emu``): numerics only, its speed means nothing.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import statistics
import sys

import torch

from _runs import run_training

PRECISIONS = {
    "bf16": ["--training.mixed_precision_param", "bfloat16"],
    "fp32": ["--training.mixed_precision_param", "float32"],
    "float8": ["--training.mixed_precision_param", "bfloat16", "--float8.enable", "true"],
}


def _float8_native() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun --nproc-per-node)")
    p.add_argument("--seq-len", type=int, default=0, help="training.seq_len (0: the config's)")
    p.add_argument("--compile", default="off,on", help="comma list of off/on")
    p.add_argument("--precision", default="bf16,float8", help=f"comma list of {list(PRECISIONS)}")
    p.add_argument("--ac", default="none,selective,full", help="comma list of activation_checkpoint.mode")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--extra", default="", help="further overrides for every run, one quoted string")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    for prec in a.precision.split(","):
        if prec not in PRECISIONS:
            raise SystemExit(f"--precision: {prec!r} is not one of {list(PRECISIONS)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}, torch {torch.__version__}, config {a.config}, {a.nproc} process(es), "
          f"{a.steps} steps, first {a.warmup} dropped")
    print(f"{'compile':>7} {'precision':>10} {'ac':>12} {'tok/s/dev':>10} {'MFU %':>6} {'peak GiB':>8}  status")
    for comp, prec, ac in itertools.product(a.compile.split(","), a.precision.split(","), a.ac.split(",")):
        overrides = ["--training.steps", str(a.steps), "--compile.enable", str(comp == "on").lower(),
                     "--activation_checkpoint.mode", ac, *PRECISIONS[prec]]
        label = prec
        if prec == "float8" and not _float8_native():
            overrides += ["--float8.emulate", "true"]
            label = "float8-emu"
        if a.seq_len:
            overrides += ["--training.seq_len", str(a.seq_len)]
        overrides += shlex.split(a.extra)
        code, rows, tail = run_training(a.config, a.nproc, overrides, a.timeout)
        timed = [r for r in rows if r["step"] > a.warmup]
        if code != 0 or not timed:
            reason = "OOM" if "out of memory" in tail.lower() else f"exit {code}"
            print(f"{comp:>7} {label:>10} {ac:>12} {'-':>10} {'-':>6} {'-':>8}  {reason}: {tail.splitlines()[-1][:80] if tail else ''}")
            continue
        tps = statistics.median(r["tokens_per_sec_per_device"] for r in timed)
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        mfu = f"{statistics.median(mfus):6.1f}" if mfus else f"{'n/a':>6}"
        mem = max(r["max_memory_gib"] for r in rows)
        print(f"{comp:>7} {label:>10} {ac:>12} {tps:10.0f} {mfu} {mem:8.2f}  ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
