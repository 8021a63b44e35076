"""The metrics fan-out: rank 0 sends every record to each enabled logger (``metrics/loggers/``:
console, metrics.jsonl, tensorboard, Weights & Biases); the other ranks log nothing.
``build_metrics_logger`` makes the run's, agreeing on a refusal across ranks."""

from __future__ import annotations

import dataclasses
import os
import resource

import torch
import torch.distributed as dist

from titan_ulysses.config.manager import ConfigError
from titan_ulysses.metrics.loggers import build_loggers
from titan_ulysses.metrics.loggers.jsonl import append_line  # noqa: F401  (its home before the loggers split)


def max_memory_gib(device: torch.device) -> float:
    """Peak reserved accelerator memory, or the process's peak resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def max_memory_allocated_gib(device: torch.device) -> float | None:
    """Peak allocated accelerator memory (what the planner's estimate models; the reserved peak adds the caching
    allocator's reserve), or None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


class MetricsLogger:
    """``settings`` is the ``[metrics]`` section (None: console and metrics.jsonl only);
    ``run_config`` the job's config as a dict (W&B records it); ``resumed``: the training run
    continues from this folder's checkpoint (W&B continues its run)."""

    def __init__(self, dump_folder: str, rank: int, settings=None, run_config: dict | None = None,
                 resumed: bool = False):
        self.rank = rank
        self.loggers = []
        if rank == 0:
            if settings is None:
                from titan_ulysses.config.job_config import Metrics

                settings = Metrics()
            os.makedirs(dump_folder, exist_ok=True)
            self.loggers = build_loggers(dump_folder, settings, run_config, resumed)

    def log(self, metrics: dict) -> None:
        for logger in self.loggers:
            logger.log(metrics)

    def log_validation(self, step: int, metrics: dict) -> None:
        """Held-out loss: a ``validation_loss`` record for every logger."""
        self.log({"step": step, **metrics})

    def log_summary(self, summary: dict) -> None:
        for logger in self.loggers:
            logger.log_summary(summary)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
        self.loggers = []


def build_metrics_logger(config, rank: int, resumed: bool) -> MetricsLogger:
    """The run's loggers (``[metrics]``; rank 0's); a W&B start-up failure (no login) reaches every
    rank as a ConfigError. Collective."""
    from titan_ulysses.metrics.loggers.wandb_logger import WandbError

    logger, error = None, None
    try:
        logger = MetricsLogger(config.job.dump_folder, rank, config.metrics, dataclasses.asdict(config),
                               resumed=resumed)
    except WandbError as e:
        error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ConfigError(box[0])
    return logger
