"""Step metrics to the console, to tensorboard when enabled, and always to metrics.jsonl (rank 0).

``metrics.jsonl`` only ever holds whole lines: each line is appended in one write, and a
write that fails (a full disk) is cut back off, with an error naming the file and the
space it needed; a partial last line left by an older crash is dropped at start-up.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import sys
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
            _drop_partial_line(self.jsonl_path)
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
        append_line(self.jsonl_path, json.dumps(metrics))
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, metrics["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to ``path`` whole, or raise OSError and leave the file as it was."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # never leave half a line
            except OSError:
                pass
            free = shutil.disk_usage(os.path.dirname(path) or ".").free
            raise OSError(e.errno, f"cannot append a line of {len(data)} bytes to {path} ({e.strerror or e}; "
                                   f"{free} bytes free on that filesystem)") from e
    finally:
        os.close(fd)


def _drop_partial_line(path: str) -> None:
    """Cut a last line without its newline (a crash mid-write by an older version) off ``path``."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                print(f"warning: dropped a partial last line of {path} ({len(data) - keep} bytes)",
                      file=sys.stderr, flush=True)
    except FileNotFoundError:
        pass
