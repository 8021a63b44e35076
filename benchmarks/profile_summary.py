"""Where a profiled step's time goes: ``torch.profiler`` events summed by kernel and by part of the step.

``summarize(prof.events(), wall_s)`` works on a CUDA profile (the device's kernels and copies)
and on a CPU one (the outermost ``aten::`` operators, which are what a CPU computes), so it is tested on CPU:

* ``top``: the kernels (or outermost operators) with the most time, and their share of all of it;
* ``idle_between_kernels_pct``: the share of the span from the first kernel's start to the last
  one's end in which none runs (the device waiting for the host); ``idle_of_wall_pct``: the
  same against the profiled steps' wall-clock time (``wall_s``), which also counts the start;
* ``parts_ms``: time in attention, linears, loss, optimizer, FSDP casts and data (``PARTS``),
  by the enclosing ``record_function`` ranges first (``FSDP::...``, ``Optimizer.step``, the
  caller's ``data``, the loss's ``titan_ulysses.loss``: its matmuls are the loss's, not linears)
  and the kernel's name second; what matches nothing is ``other``;
* ``host_syncs``: runtime calls that wait for the device (stream/device/event synchronize,
  blocking ``cudaMemcpy``) and ``scalar_reads`` (``aten::_local_scalar_dense``: ``.item()``,
  ``bool(tensor)``), which on CUDA each wait for the device.
"""

from __future__ import annotations

import re

from torch.autograd import DeviceType

# (part, pattern over the enclosing ranges' names, pattern over the kernel's / operator's own name)
PARTS = [
    ("data", r"^data$", r"Memcpy HtoD"),
    ("optimizer", r"^Optimizer\.(step|zero_grad)", r"adam"),
    ("fsdp_casts", r"^FSDP::", r"^$"),
    ("attention", r"attention|^ulysses", r"flash|fmha|sdpa|attention|attn|cudnn"),
    # the loss by its range (ops/loss/registry.py PROFILE_RANGE; a chunked backward by its autograd node's name)
    ("loss", r"^titan_ulysses\.loss$|LinearCrossEntropy|cross_entropy|chunked_loss|^loss",
     r"cross_entropy|nll_loss|log_softmax|logsumexp"),
    ("linears", r"^$", r"gemm|nvjet|cutlass|xmma|sm90_|splitk|aten::(mm|addmm|bmm|matmul|linear)$"),
]
SYNC_CALLS = re.compile(r"^(cuda|cu)(StreamSynchronize|DeviceSynchronize|EventSynchronize|CtxSynchronize)$|^cudaMemcpy$")
_COMPILED = [(name, re.compile(ranges, re.I), re.compile(own, re.I)) for name, ranges, own in PARTS]


def _ancestors(event) -> list[str]:
    names, e = [], event.cpu_parent
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


def part_of(name: str, ranges: list[str]) -> str:
    """The part of the step a kernel (or operator) ``name`` belongs to, under the ranges ``ranges``."""
    for part, by_range, by_name in _COMPILED:
        if any(by_range.search(r) for r in ranges) or (by_name.pattern != "^$" and by_name.search(name)):
            return part
    return "other"


def _device_work(events) -> tuple[str, list[tuple[str, float, float, list[str]]]]:
    """('cuda' or 'cpu', [(name, start_us, end_us, enclosing range names)]) of what the device computed."""
    cuda = [e for e in events if e.device_type == DeviceType.CUDA]
    if cuda:
        launches = {e.id: e for e in events if e.device_type == DeviceType.CPU}
        work = []
        for k in cuda:
            launch = launches.get(getattr(k, "linked_correlation_id", 0))
            ranges = ([launch.name] + _ancestors(launch)) if launch is not None else []
            work.append((k.name, k.time_range.start, k.time_range.end, ranges))
        return "cuda", work
    # a CPU computes in operators: the outermost ``aten::`` ones (an ``aten::linear`` with its ``aten::mm``
    # inside counts once, as a linear), each with the ranges around it
    work = []
    for e in events:
        if e.device_type == DeviceType.CPU and not e.is_async and e.name.startswith("aten::"):
            ranges = _ancestors(e)
            if not any(r.startswith("aten::") for r in ranges):
                work.append((e.name, e.time_range.start, e.time_range.end, ranges))
    return "cpu", work


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def summarize(events, wall_s: float | None = None, top: int = 12) -> dict:
    """The summary described in the module's docstring, JSON-ready (times in ms)."""
    kind, work = _device_work(events)
    if not work:
        return {"device": kind, "error": "the profile holds no kernels or operators"}
    total = sum(e - s for _, s, e, _ in work)
    by_name: dict[str, float] = {}
    parts = {p: 0.0 for p, _, _ in PARTS} | {"other": 0.0}
    for name, s, e, ranges in work:
        by_name[name] = by_name.get(name, 0.0) + (e - s)
        parts[part_of(name, ranges)] += e - s
    span = max(e for _, _, e, _ in work) - min(s for _, s, _, _ in work)
    busy = _union_us([(s, e) for _, s, e, _ in work])
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    out = {
        "device": kind,
        "kernels": len(work),
        "kernel_ms": total / 1e3,
        "busy_ms": busy / 1e3,
        "span_ms": span / 1e3,
        "idle_between_kernels_pct": 100 * (span - busy) / span if span else 0.0,
        "parts_ms": {p: v / 1e3 for p, v in parts.items()},
        "parts_pct": {p: 100 * v / total for p, v in parts.items()},
        "top": [{"name": n[:120], "ms": v / 1e3, "pct": 100 * v / total}
                for n, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
        "host_syncs": sum(1 for e in cpu if SYNC_CALLS.match(e.name)),
        "scalar_reads": sum(1 for e in cpu if e.name == "aten::_local_scalar_dense"),
    }
    if wall_s:
        out["wall_ms"] = wall_s * 1e3
        out["idle_of_wall_pct"] = max(0.0, 100 * (1 - busy / 1e6 / wall_s))
    return out


def profile(step, n_steps: int, cuda: bool) -> tuple[dict, object]:
    """Run ``step()`` ``n_steps`` times under ``torch.profiler`` (device kernels too on CUDA), with
    CUDA's sync debug mode counting the steps' synchronizing calls; (summary, profiler)."""
    import time
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, torch_profile(activities=activities) as prof:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        try:
            for _ in range(n_steps):
                step()
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        wall = time.perf_counter() - start
    summary = summarize(prof.events(), wall)
    summary["steps"] = n_steps
    if cuda:
        summary["sync_debug_warnings"] = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return summary, prof
