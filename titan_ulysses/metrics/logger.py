"""Step metrics to the console, to tensorboard when enabled, and always to metrics.jsonl (rank 0)."""

from __future__ import annotations

import json
import os
import resource
import time

import torch


def max_memory_gib(device: torch.device) -> float:
    """Peak reserved accelerator memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsLogger:
    def __init__(self, dump_folder: str, rank: int, enable_tensorboard: bool):
        self.rank = rank
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl")
        self.tb = None
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            if enable_tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(dump_folder, "tb", time.strftime("%Y%m%d-%H%M%S")))

    def log(self, metrics: dict) -> None:
        if self.rank != 0:
            return
        step = metrics["step"]
        mfu = metrics.get("mfu")
        print(
            f"step {step:>5}  loss {metrics['loss']:.4f}  grad_norm {metrics['grad_norm']:.3f}  "
            f"lr {metrics['lr']:.2e}  tok/s/dev {metrics['tokens_per_sec_per_device']:,.0f}  "
            + (f"mfu {mfu:.1f}%  " if mfu is not None else "")
            + f"mem {metrics['max_memory_gib']:.2f} GiB"
            + (f"  loss_tokens {metrics['loss_tokens']:,}  pad {100 * metrics['padding']:.1f}%"
               if "loss_tokens" in metrics else "")
            + (f"  truncated {metrics['truncated']}" if metrics.get("truncated") else "")
            + (f"  dropped {metrics['dropped']}" if metrics.get("dropped") else ""),
            flush=True,
        )
        self._write(metrics)

    def log_validation(self, step: int, metrics: dict) -> None:
        """Held-out loss: one console line, a ``validation_loss`` record in metrics.jsonl and tensorboard."""
        if self.rank != 0:
            return
        print(f"step {step:>5}  validation_loss {metrics['validation_loss']:.4f}  "
              f"tokens {metrics['validation_tokens']:,}", flush=True)
        self._write({"step": step, **metrics})

    def _write(self, metrics: dict) -> None:
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, metrics["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
