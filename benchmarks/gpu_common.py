"""What the GPU suite's runner (``scripts/gpu_suite.py``), its correctness cases (``tests/gpu/``) and
its performance cases (``benchmarks/``) share: a case, what it is given, how it says it cannot run,
and train.py in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "train_configs")
DEBUG = os.path.join(CONFIGS, "debug_model.toml")


@dataclass
class Context:
    """What every case gets: where it runs, at which size, and how much time is left."""

    device: torch.device
    dry_run: bool
    out: str
    deadline: float
    results: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, wanted: float) -> float:
        """A subprocess timeout that never runs past the part's budget."""
        return max(5.0, min(wanted, self.remaining() - 5))


class Skip(Exception):
    """Raised by a case that cannot run here (the message says why)."""


@dataclass
class Case:
    name: str
    fn: object
    est_s: float  # on the GPU; the runner skips the case when less than this is left
    dry_est_s: float = 0.0


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Frobenius norm of the difference relative to the reference's."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def tagged_json(argv: list[str], tag: str, timeout: float) -> tuple[dict | None, str]:
    """Run ``argv`` in the repository and read the JSON its stdout prints after ``TAG `` (the way a case's
    subprocess reports): ``(that dict, "")``, or ``(None, why)`` with the output's tail when it timed out or
    printed no such line."""
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    for line in proc.stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:]), ""
    return None, f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"


def train(ctx, overrides: list[str], dump: str, config: str = DEBUG, nproc: int = 1, timeout: float = 300):
    """Run train.py (as ``scripts/_runs.py`` does for the bench scripts); returns (exit code, metrics
    rows, output tail)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "train.py"), "--config", config, "--job.dump_folder", dump,
           "--checkpoint.enable", "false", "--metrics.log_freq", "1", *overrides]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.timeout(timeout))
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        code, out = 124, "timed out"
    if code:  # the whole story goes to the suite's log; the row gets the error line
        print(f"---- train.py exit {code}: {' '.join(overrides)}\n" + "\n".join(out.splitlines()[-60:]),
              file=sys.stderr, flush=True)
        errors = [ln.strip() for ln in out.splitlines()
                  if re.match(r"^\s*([\w.]*(Error|Exception)\b|config error: |out of memory: )", ln)]
        out = "\n".join(errors[-1:] + out.strip().splitlines()[-2:])
    path = os.path.join(dump, "metrics.jsonl")
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        os.remove(path)  # a rerun in the same folder appends
    return code, rows, "\n".join(out.strip().splitlines()[-4:])
