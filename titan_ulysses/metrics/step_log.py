"""When a step line is due, and what it says beyond the step's own numbers: throughput and MFU
since the last line, the communication model, memory and system metrics, elapsed time and ETA.

Built once per run (the model's FLOPs per token and the bytes each step exchanges do not
change), so a logging step only reads clocks and counters.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from titan_ulysses.metrics.comm import context_parallel_bytes_per_step, ulysses_bytes_per_step
from titan_ulysses.metrics.flops import flops_per_token, peak_flops
from titan_ulysses.metrics.logger import max_memory_allocated_gib, max_memory_gib
from titan_ulysses.metrics.progress import RunProgress
from titan_ulysses.metrics.system import system_metrics


class StepLog:
    """``params``: (trainable, total) parameters; ``options``: the model's ParallelizeOptions."""

    def __init__(self, config, args, parallel_dims, options, global_batch_size: int, device: torch.device,
                 params: tuple[int, int], start_step: int):
        t, pd = config.training, parallel_dims
        self.every, self.last_step, self.device = config.metrics.log_freq, t.steps, device
        self.link_bytes_per_sec = config.comm.link_bandwidth_gbps * 1e9
        self.trainable_params, self.total_params = params
        self.tokens_per_step = global_batch_size * t.seq_len
        self.world = dist.get_world_size()
        self.flops_per_token = flops_per_token(args, t.seq_len, self.trainable_params if options.lora is not None else 0)
        self.peak_flops = peak_flops(device)
        comm_args = (torch.finfo(options.param_dtype).bits // 8, options.ac_mode in ("full", "full_offload"))
        rows = global_batch_size // pd.size("dp")
        self.a2a_bytes = ulysses_bytes_per_step(args, t.seq_len, rows, pd.sp, pd.tp, *comm_args, cp=pd.cp)
        self.cp_bytes = context_parallel_bytes_per_step(args, t.seq_len, rows, pd.cp, pd.sp, pd.tp, *comm_args)
        self.progress = RunProgress(start_step, t.steps, self.tokens_per_step)
        self.timer, self.steps_timed = time.perf_counter(), 0

    def start(self) -> None:
        """The throughput clock starts with the loop, not at construction."""
        self.timer, self.steps_timed = time.perf_counter(), 0

    def due(self, step: int) -> bool:
        """Every ``metrics.log_freq`` steps, the first and the last."""
        return step % self.every == 0 or step == 1 or step == self.last_step

    def stepped(self, loss: float | None) -> None:
        """A step ran; ``loss``: its loss, None where the step was not read (``training.sync_free_step``)."""
        self.steps_timed += 1
        if loss is not None:
            self.progress.last_loss = loss

    def exclude(self, seconds: float) -> None:
        """Time that is not training throughput (evaluation)."""
        self.timer += seconds

    def record(self, step: int, out: dict, lr: float, data_wait_sec: float, model, optimizer) -> dict:
        """The step line of ``step`` (``out``: the step's own numbers); restarts the throughput clock."""
        elapsed = time.perf_counter() - self.timer
        tps = self.tokens_per_step * self.steps_timed / elapsed / self.world
        mfu = None if self.peak_flops is None else 100 * tps * self.flops_per_token / self.peak_flops
        line = {
            "step": step, **out, "lr": lr, "tokens_per_sec_per_device": tps,
            "mfu": mfu, "max_memory_gib": max_memory_gib(self.device),
            **({"max_memory_allocated_gib": allocated} if (allocated := max_memory_allocated_gib(self.device)) else {}),
            "trainable_params": self.trainable_params, "params": self.total_params,
            "a2a_gib_per_step": self.a2a_bytes / 2**30,
            "a2a_model_sec": self.a2a_bytes / self.link_bytes_per_sec,
            **({"cp_gib_per_step": self.cp_bytes / 2**30} if self.cp_bytes else {}),
            "data_wait_sec": data_wait_sec / self.steps_timed,  # rank 0's, per step
            **system_metrics(self.device, model, optimizer),
            **self.progress.timing(step),
        }
        self.timer, self.steps_timed = time.perf_counter(), 0
        return line
