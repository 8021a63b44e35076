"""What runs at step boundaries to look at the process (``[profiling]``) or tidy it (``training.gc_freq``).

* :class:`StepProfiler`: torch.profiler traces (Chrome/Perfetto JSON, CPU and CUDA activity) of the
  last ``profiler_active`` steps of every ``profile_freq``, and CUDA memory snapshots every
  ``memory_snapshot_freq`` steps. Step numbers are the run's own, so a resumed run's traces are named
  by the steps they hold.
* :func:`profile_steps` and :func:`summarize`: N steady steps of any step function under the profiler,
  and the figures a performance case reports (top kernels, device idle share, host-device syncs);
  the GPU suite's profile case uses them.
* :class:`StepGC`: Python's garbage collection only at step boundaries (automatic collection off,
  the objects of start-up frozen), so that a collection never lands inside a step's kernels' launch.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, schedule

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""Runtime calls after which the host has waited for the device."""


def check_memory_snapshot(enable: bool) -> None:
    """``profiling.enable_memory_snapshot`` records the CUDA caching allocator: refused without a GPU."""
    if enable and not torch.cuda.is_available():
        raise ValueError("profiling.enable_memory_snapshot needs CUDA (it records the CUDA caching allocator) and no "
                         "GPU is visible; set it false (profiling.enable_profiling traces work on CPU too)")


def activities(device_type: str) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])


class StepProfiler:
    """Traces and memory snapshots at chosen steps of a run; :meth:`step` after every step, :meth:`close` at the end.

    ``p`` is the ``[profiling]`` section; files go under ``dump_folder``; ``start_step`` is the
    step the run starts from (a resume), so that trace N holds the run's step N."""

    def __init__(self, p, dump_folder: str, rank: int, start_step: int, device_type: str):
        self.rank, self.prof, self.snapshot_folder = rank, None, None
        if p.enable_profiling:
            traces = os.path.join(dump_folder, p.save_traces_folder)
            wait = p.profile_freq - p.profiler_warmup - p.profiler_active
            self.prof = profile(activities=activities(device_type), record_shapes=False,
                                schedule=schedule(wait=wait, warmup=p.profiler_warmup, active=p.profiler_active),
                                on_trace_ready=lambda prof: self._save_trace(prof, traces))
            # the schedule counts from step_num: start it at the run's step, so trace N is step N
            self.prof.step_num = start_step
            self.prof.current_action = self.prof.schedule(start_step)
            self.prof.start()
        if p.enable_memory_snapshot and device_type == "cuda":
            self.snapshot_folder = os.path.join(dump_folder, p.save_memory_snapshot_folder)
            self.snapshot_freq = p.memory_snapshot_freq or p.profile_freq
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    def _save_trace(self, prof, traces: str) -> None:
        folder = os.path.join(traces, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))

    def step(self, step: int) -> None:
        """Step ``step`` (1-based, the run's count) has ended."""
        if self.prof is not None:
            self.prof.step()
        if self.snapshot_folder is not None and step % self.snapshot_freq == 0:
            folder = os.path.join(self.snapshot_folder, f"step_{step}")
            os.makedirs(folder, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"))

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.snapshot_folder is not None:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_folder = None


def profile_steps(run_step: Callable[[], object], steps: int, warmup: int = 1, device_type: str = "cpu",
                  trace_path: str | None = None) -> dict:
    """Run ``run_step`` ``warmup`` times unrecorded, then ``steps`` times under the profiler; returns
    :func:`summarize`'s figures (and writes the Chrome trace to ``trace_path`` when given)."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    for _ in range(warmup):
        run_step()
    sync()
    with profile(activities=activities(device_type)) as prof:
        for _ in range(steps):
            run_step()
        sync()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return summarize(prof, steps, device_type)


def summarize(prof, steps: int, device_type: str = "cpu", top: int = 10) -> dict:
    """From a finished profile: the ``top`` operators or kernels by self time (the device's on CUDA,
    the host's on CPU) with their share, the device's idle share of the window between its first and
    last kernel (CUDA; None on CPU), and the host-device syncs per step (calls of ``SYNC_CALLS``)."""
    cuda = device_type == "cuda"
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us()
        idle = idle_share([(e.time_range.start, e.time_range.end) for e in kernels])
    else:
        by_name = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        idle = None
    total = sum(by_name.values()) or 1.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    return {"top": [{"name": n, "us_per_step": t / steps, "share": t / total} for n, t in ranked],
            "idle_share": idle, "syncs_per_step": syncs / steps, "steps": steps}


def idle_share(intervals: list[tuple[float, float]]) -> float | None:
    """Share of [first start, last end] that no interval covers (the device waiting for the host)."""
    if not intervals:
        return None
    intervals = sorted(intervals)
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(e for _, e in intervals) - intervals[0][0]
    return 0.0 if span <= 0 else 1.0 - busy / span


def trace_events(path: str) -> list[dict]:
    """The events of a Chrome trace file written by the profiler."""
    with open(path) as f:
        return json.load(f)["traceEvents"]


class StepGC:
    """Garbage collection at step boundaries (torchtitan's ``gc_freq``): with ``freq`` > 0 automatic
    collection is off, start-up's objects are collected once and frozen (later collections skip them),
    and :meth:`step` collects every ``freq`` steps. ``freq`` 0 leaves Python's automatic collection
    as it is. :meth:`close` restores it."""

    def __init__(self, freq: int):
        self.freq = freq
        self.was_enabled = gc.isenabled()
        if freq > 0:
            gc.disable()
            gc.collect()
            gc.freeze()

    def step(self, step: int) -> bool:
        """Step ``step`` has ended; whether a collection ran."""
        if self.freq > 0 and step % self.freq == 0:
            gc.collect(1)
            return True
        return False

    def close(self) -> None:
        if self.freq > 0:
            gc.unfreeze()
            if self.was_enabled:
                gc.enable()
            self.freq = 0
