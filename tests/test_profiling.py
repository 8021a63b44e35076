"""``[profiling]`` and ``training.gc_freq`` (``metrics/profiling.py``): traces at the chosen steps of the
run's own count (a resumed run too), the figures a performance case reads from a profile, garbage
collection only at step boundaries, and the one-line refusals. The trainer's own trace is checked in
``test_host_syncs.py`` (its run writes one)."""

import gc
import os
import weakref

import pytest
import torch

from helpers import trace_events
from titan_ulysses.config.manager import ConfigError, check_config, load_config
from titan_ulysses.config.profiling import Profiling
from titan_ulysses.metrics.profiling import StepGC, StepProfiler, check_memory_snapshot


def _toy_step():
    a = torch.randn(32, 32)
    return (a @ a).sum()


@pytest.mark.parametrize("start", [0, 4])
def test_traces_land_at_every_profile_freq_th_step_of_the_run(tmp_path, start):
    p = Profiling(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    profiler = StepProfiler(p, str(tmp_path), rank=1, start_step=start, device_type="cpu")
    for step in range(start + 1, 10):
        _toy_step()
        profiler.step(step)
    profiler.close()
    folder = tmp_path / "profiling" / "traces"
    want = [f"iteration_{s}" for s in (3, 6, 9) if s > start]
    assert sorted(os.listdir(folder)) == want
    events = trace_events(str(folder / want[-1] / "rank1_trace.json"))
    names = {e.get("name", "") for e in events}
    assert "aten::mm" in names and "ProfilerStep#8" in names and "ProfilerStep#7" not in names, sorted(names)[:20]


class _Cycle:
    def __init__(self):
        self.me = self


def test_gc_runs_only_every_gc_freq_steps():
    collector = StepGC(2)
    try:
        assert not gc.isenabled()
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        del cycle
        for _ in range(2000):  # enough allocations to trigger an automatic collection, were it on
            _Cycle().me = None
        assert not collector.step(1) and alive() is not None, "collected off the step boundary"
        assert collector.step(2) and alive() is None, "not collected at the gc_freq-th step"
    finally:
        collector.close()
    assert gc.isenabled()
    StepGC(0).close()
    assert gc.isenabled()


@pytest.mark.parametrize("argv, line", [
    (["--profiling.enable_profiling", "true", "--profiling.profile_freq", "3"],
     "profiling.profiler_warmup 3 + profiling.profiler_active 1 must be <= profiling.profile_freq 3"),
    (["--profiling.profile_freq", "0"], "profiling.profile_freq must be >= 1, got 0"),
    (["--training.gc_freq", "-1"], "training.gc_freq must be >= 0, got -1"),
    (["--profiling.save_traces_folder", " "], "profiling.save_traces_folder is empty"),
])
def test_profiling_settings_are_refused_in_one_line(argv, line):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(["--config", "debug_model"] + argv), 2)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_memory_snapshot_without_cuda_is_refused():
    if torch.cuda.is_available():
        check_memory_snapshot(True)  # accepted where a GPU is
        return
    with pytest.raises(ValueError, match=r"^profiling.enable_memory_snapshot needs CUDA .* no GPU is visible; set it false"):
        check_memory_snapshot(True)
