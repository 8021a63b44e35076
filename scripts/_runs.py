"""Run ``train.py`` in a subprocess with overrides and read back its metrics (shared by the bench scripts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_command(config: str, nproc: int, overrides: list[str], dump_folder: str) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [*launcher, os.path.join(ROOT, "train.py"), "--config", config, "--job.dump_folder", dump_folder,
            "--checkpoint.enable", "false", "--metrics.log_freq", "1", *overrides]


def run_training(config: str, nproc: int, overrides: list[str], timeout: float) -> tuple[int, list[dict], str]:
    """(exit code, metrics rows, last lines of output) of one short training run."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = train_command(config, nproc, overrides, dump)
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            code, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            code, out = 124, f"timed out after {timeout:.0f} s: {e}"
        path = os.path.join(dump, "metrics.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
    return code, rows, "\n".join(out.strip().splitlines()[-5:])
