"""The longest training.seq_len that trains (forward, backward, optimizer step) for a config and layout.

    python scripts/max_seq_len.py --config train_configs/llama3_1b_long.toml --start 131072
    python scripts/max_seq_len.py --config train_configs/debug_model.toml --nproc 2 \\
        --start 512 --max 4096 --multiple 256                       # CPU smoke run

Doubles seq_len from ``--start`` until a run fails with out-of-memory (or ``--max`` is
reached), then bisects between the last length that trained and the first that did not,
to a precision of ``--multiple`` tokens. Each trial is two training steps of ``train.py``
in its own process with local batch 1. Any failure other than out-of-memory stops the
search and is shown: it is a bug or a setting to fix, not a length limit. A simulated rank
of an N-GPU job: ``--extra "--comm.mode fake --comm.fake_world_size 8 --parallelism.ulysses_degree 8"``.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch

from _runs import run_training


def trains(a, seq_len: int) -> bool:
    overrides = ["--training.seq_len", str(seq_len), "--training.steps", "2", "--training.local_batch_size", "1",
                 "--training.global_batch_size", "-1", *shlex.split(a.extra)]
    code, rows, tail = run_training(a.config, a.nproc, overrides, a.timeout)
    if code == 0 and rows:
        peak = max(r["max_memory_gib"] for r in rows)
        print(f"seq_len {seq_len:>9}: trains, peak {peak:.2f} GiB", flush=True)
        return True
    if "out of memory" in tail.lower() or "outofmemoryerror" in tail.lower():
        print(f"seq_len {seq_len:>9}: out of memory", flush=True)
        return False
    raise SystemExit(f"seq_len {seq_len} failed for another reason than memory (exit {code}):\n{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--start", type=int, default=8192)
    p.add_argument("--max", type=int, default=16 * 1024 * 1024)
    p.add_argument("--multiple", type=int, default=8192, help="precision of the search, in tokens")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per trial")
    p.add_argument("--extra", default="", help="further overrides for every trial, one quoted string")
    a = p.parse_args(argv)
    if a.start % a.multiple or a.start <= 0:
        raise SystemExit(f"--start {a.start} must be a positive multiple of --multiple {a.multiple}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}, torch {torch.__version__}, config {a.config}, {a.nproc} process(es), extra {a.extra!r}")
    good, bad = 0, None
    length = a.start
    while length <= a.max:
        if not trains(a, length):
            bad = length
            break
        good, length = length, length * 2
    if bad is not None:
        while bad - good > a.multiple:
            mid = (good + bad) // 2 // a.multiple * a.multiple
            if mid <= good:
                break
            if trains(a, mid):
                good = mid
            else:
                bad = mid
    limit = f"(first failing length {bad})" if bad is not None else f"(--max {a.max} reached)"
    print(f"longest seq_len that trains: {good} {limit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
