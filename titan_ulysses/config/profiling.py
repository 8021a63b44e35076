"""The ``[profiling]`` section, with torchtitan's setting names: profiler traces and CUDA memory
snapshots at chosen steps (``metrics/profiling.py`` takes them). A leaf like the rest of ``config/``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (Chrome/Perfetto JSON, CPU and CUDA activity), one per rank, at every
    profile_freq-th step: save_traces_folder/iteration_N/rankR_trace.json (open in ui.perfetto.dev)."""
    save_traces_folder: str = "profiling/traces"
    """Where traces go, under job.dump_folder."""
    profile_freq: int = 10
    """Trace every this many steps: the last profiler_active steps of each profile_freq, after
    profiler_warmup steps of warmup (the rest of the cycle runs unprofiled)."""
    profiler_warmup: int = 3
    """Steps profiled but not recorded before each trace (the profiler's own start-up cost)."""
    profiler_active: int = 1
    """Steps recorded in each trace; profiler_warmup + profiler_active <= profile_freq."""
    enable_memory_snapshot: bool = False
    """CUDA only: record the allocator's history and dump a snapshot (open in pytorch.org/memory_viz)
    every memory_snapshot_freq steps: save_memory_snapshot_folder/step_N/rankR_memory_snapshot.pickle."""
    memory_snapshot_freq: int = 0
    """Dump a memory snapshot every this many steps; 0 = profile_freq."""
    save_memory_snapshot_folder: str = "profiling/memory_snapshot"
    """Where memory snapshots go, under job.dump_folder."""


def check_profiling(p: Profiling) -> str | None:
    """The refusal for the ``[profiling]`` section ``p`` (beyond its ranges), or None."""
    if p.enable_profiling and p.profiler_warmup + p.profiler_active > p.profile_freq:
        return (f"profiling.profiler_warmup {p.profiler_warmup} + profiling.profiler_active {p.profiler_active} must "
                f"be <= profiling.profile_freq {p.profile_freq}: raise profile_freq or lower the other two")
    for name in ("save_traces_folder", "save_memory_snapshot_folder"):
        if not getattr(p, name).strip():
            return f"profiling.{name} is empty; name a folder (relative to job.dump_folder)"
    return None
