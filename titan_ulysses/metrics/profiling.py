"""What runs at step boundaries to look at the process (``[profiling]``) or tidy it (``training.gc_freq``).

* :class:`StepProfiler`: torch.profiler traces (Chrome/Perfetto JSON, CPU and CUDA activity) of the
  last ``profiler_active`` steps of every ``profile_freq``, and CUDA memory snapshots every
  ``memory_snapshot_freq`` steps. Step numbers are the run's own, so a resumed run's traces are named
  by the steps they hold.
* :class:`StepGC`: Python's garbage collection only at step boundaries (automatic collection off,
  the objects of start-up frozen), so that a collection never lands inside a step's kernels' launch.
"""

from __future__ import annotations

import gc
import os

import torch
from torch.profiler import ProfilerActivity, profile, schedule


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
