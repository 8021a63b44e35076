"""System metrics of rank 0 for every log step: accelerator memory and utilization, host
memory, bytes held in host memory for the device (offload), and time spent waiting on data."""

from __future__ import annotations

import os
import time

import torch

GIB = 2**30


def host_rss_gib() -> float:
    """This process's resident memory now (not its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what there is
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def gpu_utilization(device: torch.device) -> float | None:
    """Percent of the last sample period a kernel ran (NVML through torch); None where unavailable."""
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # no pynvml / amdsmi, or a driver without the query
        return None


def host_offload_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Bytes kept in host memory on the device's behalf: FSDP CPU offload's parameters, gradients
    and optimizer state, plus what activation offload moved in the last forward. 0 on a CPU run."""
    if device.type == "cpu":
        return 0
    total = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if local.device.type == "cpu":
            total += local.numel() * local.element_size()
            if p.grad is not None:
                g = getattr(p.grad, "_local_tensor", p.grad)
                total += g.numel() * g.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = getattr(value, "_local_tensor", value)
                if local.device.type == "cpu" and local.dim() > 0:
                    total += local.numel() * local.element_size()
    offloader = getattr(model, "activation_offloader", None)
    return total + (offloader.offloaded_bytes if offloader is not None else 0)


def system_metrics(device: torch.device, model, optimizer) -> dict:
    """The system part of a step record (GiB, percent)."""
    out = {"host_rss_gib": host_rss_gib(), "host_offload_gib": host_offload_bytes(model, optimizer, device) / GIB}
    if device.type == "cuda":
        out["gpu_memory_allocated_gib"] = torch.cuda.memory_allocated(device) / GIB
        out["gpu_memory_reserved_gib"] = torch.cuda.memory_reserved(device) / GIB
        util = gpu_utilization(device)
        if util is not None:
            out["gpu_utilization_pct"] = util
    return out


class WaitTimer:
    """Seconds spent inside ``next()`` of a data iterator, summed until ``take()``."""

    def __init__(self):
        self.seconds = 0.0

    def next(self, iterator):
        start = time.perf_counter()
        try:
            return next(iterator)
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
