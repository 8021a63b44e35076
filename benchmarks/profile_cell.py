"""One training cell of ours under ``torch.profiler``: warm-up steps, then ``--steps`` profiled steady steps.

    python -m benchmarks.profile_cell '{"argv": ["--config", "train_configs/llama3_1b_long.toml", ...],
                                        "warmup": 3, "steps": 2, "trace": "DIR/trace.json"}'

Builds the ``Trainer`` of ``argv`` in this process (one rank, or a simulated rank with
``--comm.mode fake``), runs ``warmup`` steps (compilation, allocator), then profiles ``steps``
steps of ``Trainer.train_step`` with its own loader, each fetch inside a ``data`` range and each step
followed by ``Trainer.stepped``, as ``Trainer.train`` runs them (the profiled steps are not log steps
under ``--metrics.log_freq 10``), and prints one line ``PROFILE {json}``: ``benchmarks/profile_summary.py``'s summary. ``trace``
(optional) also writes the Chrome/Perfetto trace. The GPU suite's ``profile_1b_16k`` runs it.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import record_function


class _Ranged:
    """An iterator whose every ``next`` runs inside a ``data`` profiler range."""

    def __init__(self, it):
        self.it = it

    def __iter__(self):
        return self

    def __next__(self):
        with record_function("data"):
            return next(self.it)


def main(spec: dict) -> int:
    from benchmarks.profile_summary import profile
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.trainer import Trainer

    config = load_config([*spec["argv"], "--checkpoint.enable", "false"])
    trainer = Trainer(config)
    cuda = trainer.device.type == "cuda"
    data = _Ranged(iter(trainer.dataloader))

    def step():  # what Trainer.train's loop does around a step that is not logged
        first = trainer.step == 0
        trainer.train_step(data)
        trainer.stepped(first)

    for _ in range(spec.get("warmup", 2)):
        step()
    summary, prof = profile(step, spec.get("steps", 2), cuda)
    if spec.get("trace"):
        prof.export_chrome_trace(spec["trace"])
    if cuda:
        summary["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
        summary["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("PROFILE " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
