"""Tensorboard event files under ``{dump_folder}/tb/<start time>``."""

from __future__ import annotations

import os
import time

from titan_ulysses.metrics.loggers.base import numeric


class TensorboardLogger:
    def __init__(self, dump_folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(dump_folder, "tb", time.strftime("%Y%m%d-%H%M%S")))

    def log(self, metrics: dict) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, metrics["step"])

    def log_summary(self, summary: dict) -> None:
        self.writer.add_text("summary", "\n".join(f"{k}: {v}" for k, v in summary.items()))

    def close(self) -> None:
        self.writer.close()
