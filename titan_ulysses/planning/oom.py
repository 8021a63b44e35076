"""Never a raw out-of-memory: the launch refuses a layout predicted over the device, and a step that still runs
out of device memory ends in one line.

``launch_refusal`` is what ``preflight.check_device`` raises before the model is built: the predicted peak
(``device_fit.py``: the estimate plus what a measured cell of the same step reserved beyond it) against the
device's memory, the device, and the fastest switches that fit at this layout (``fastest.py``), else the layout
``recommend.py`` finds. ``training.allow_over_memory_estimate`` launches anyway. ``oom_line`` is what train.py
prints on every rank when a step raises ``torch.OutOfMemoryError``: the phase (from the traceback), the bytes
asked for and free (from the allocator's message), the prediction for this layout and the switch that fits.
"""

from __future__ import annotations

import os
import re
import traceback

from titan_ulysses.planning.inputs import GIB, from_config

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_TRIED = re.compile(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB|B)")
_TOTAL = re.compile(r"total capacity of ([\d.]+) (GiB|MiB|KiB|B)")
_FREE = re.compile(r"of which ([\d.]+) (GiB|MiB|KiB|B) (?:is )?free")


def _bytes(pattern: re.Pattern, text: str) -> float | None:
    m = pattern.search(text)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def _plan(config, dims, args, device_bytes: float):
    """(args, layout, switches, the device's rates, the prediction of this step) on a device of ``device_bytes``."""
    from titan_ulysses.planning.device_fit import predicted
    from titan_ulysses.planning.rates import device_rates

    args, layout, switches = from_config(config, dims, args)
    t = config.training
    rates = device_rates(memory_gib=device_bytes / GIB)
    pred = predicted(args, layout, switches, t.seq_len, t.local_batch_size, config.compile.enable, rates.device)
    return args, layout, switches, rates, pred


def what_fits(config, dims, args, device_bytes: float) -> str:
    """The fastest switches that fit at this layout with their prediction, else the layout recommend.py finds."""
    from titan_ulysses.planning.fastest import fastest
    from titan_ulysses.planning.rates import kernel_of
    from titan_ulysses.planning.recommend import BUDGET, recommend

    args, layout, switches, rates, _ = _plan(config, dims, args, device_bytes)
    t = config.training
    best = fastest(args, layout, switches, t.seq_len, t.local_batch_size, rates, device_bytes,
                   config.compile.enable, simulated=config.comm.mode == "fake",
                   precision="float8" if config.float8.enable else "bf16",
                   attention=kernel_of(config.model.attn_backend))
    if best is not None:
        return f"at this layout {best.line()} (an {rates.device} by the step-time model)"
    rec = recommend(args, layout, switches, t.seq_len, t.local_batch_size, dims.world_size, BUDGET * device_bytes,
                    config.model.attn_backend)
    if rec is None:
        return "no ulysses_degree within the job and no memory switch makes it fit: shorten training.seq_len"
    return f"nothing fits at this layout; scripts/estimate_memory.py recommends {' '.join(rec[1])}"


def launch_refusal(config, dims, device_bytes: float, args=None, device: str = "") -> str | None:
    """One line when this layout's predicted peak exceeds ``device_bytes``; None when it fits."""
    args, _, _, rates, pred = _plan(config, dims, args, device_bytes)
    if pred.total <= device_bytes:
        return None
    where = device or f"{device_bytes / GIB:.1f} GiB"
    return (f"the predicted peak of this layout is {pred.total / GIB:.2f} GiB per device (estimate "
            f"{pred.estimate / GIB:.2f} GiB; {pred.note()}), more than the device's {device_bytes / GIB:.2f} GiB "
            f"({where}; seq_len {config.training.seq_len}, layout {dims.degrees}); "
            f"{what_fits(config, dims, args, device_bytes)}; training.allow_over_memory_estimate true launches "
            f"it anyway")


def phase_of(tb) -> str:
    """The step's phase an exception was raised in, from its traceback: the loss's, a backward, clipping,
    the optimizer step, else the forward."""
    frames = traceback.extract_tb(tb)
    files = [f.filename.replace(os.sep, "/") for f in frames]
    names = [f.name for f in frames]
    loss = any(f.endswith("/ops/loss.py") or "/ops/loss/" in f for f in files)
    if any("optim" in f and n in ("step", "optimizer_step", "_fused_adamw") for f, n in zip(files, names)) or \
            "optimizer_step" in names:
        return "optimizer step"
    if "clip_grad_norm_" in names:
        return "clip grad norm"
    if any(n in ("backward", "_engine_run_backward", "run_backward") for n in names):
        return "loss backward" if loss else "backward"
    return "loss forward" if loss else "forward"


def oom_line(error: BaseException, config, dims, args, step: int, device_bytes: float | None = None) -> str:
    """The one line a rank prints when step ``step`` ran out of device memory."""
    text = str(error)
    asked, free = _bytes(_TRIED, text), _bytes(_FREE, text)
    total = _bytes(_TOTAL, text) or device_bytes
    if free is None or total is None:
        import torch

        if torch.cuda.is_available():
            free, total = (float(x) for x in torch.cuda.mem_get_info())
    gib = lambda b: "?" if b is None else f"{b / GIB:.2f}"  # noqa: E731
    head = (f"step {step} ran out of device memory in {phase_of(error.__traceback__)}: asked for {gib(asked)} GiB "
            f"with {gib(free)} GiB free of {gib(total)} GiB")
    if total is None:
        return head + "; the device's memory is unknown, so no prediction to compare"
    args, _, _, _, pred = _plan(config, dims, args, total)
    return (f"{head}; the planner predicts {pred.total / GIB:.1f} GiB for this layout ({pred.note()}); "
            f"{what_fits(config, dims, args, total)}")
