"""What the GPU suite's runner and its cases share (a module of its own, so that ``Skip`` is one
class whether ``gpu_suite.py`` runs as the main script or is imported)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


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
