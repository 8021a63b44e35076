"""The fastest memory switches that fit a device at a given layout: the step-time model over what fits.

``recommend.py`` finds the first layout and switches that fit (memory only); this ranks every combination of
AC mode, head stages, MLP tiles, loss chunk and FSDP CPU offload at the config's own layout by predicted step
time (``timing.py``), among those whose predicted peak (``device_fit.py``: the estimate plus what a measured
cell of the same step reserved beyond it) fits ``BUDGET`` of the device. Where a cell measured the same step on
this device (same kernel), its tok/s stands for the prediction; a layout no cell has measured (its compiled
peak unknown beyond the estimate) must beat the best measured one by more than ``UNMEASURED_MARGIN`` (the
model's largest error on a held-out cell it explains) to be chosen over it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from titan_ulysses.planning.device_fit import Predicted, measured_cell, predicted
from titan_ulysses.planning.inputs import GIB, Layout, Switches
from titan_ulysses.planning.rates import DeviceRates
from titan_ulysses.planning.recommend import BUDGET
from titan_ulysses.planning.timing import TRAFFIC, StepTime, step_time

UNMEASURED_MARGIN = 0.07
"""scripts/check_timing.py: the largest error on a held-out 8B cell is 6.7% (2026-11-28)."""
AC_MODES = ("none", "selective", "full", "full_offload")
TILE, CHUNK = 8192, 8192


@dataclass
class Choice:
    switches: Switches
    overrides: list[str]
    memory: Predicted
    time: StepTime
    measured_tok_s: float | None = None  # a cell's on this device, where one measured this step
    measured_from: str = ""  # which cell, and whether the model's traffic was added to it

    @property
    def tok_s(self) -> float:
        return self.measured_tok_s or self.time.tok_s

    def line(self) -> str:
        what = " ".join(self.overrides) or "the config's own switches"
        speed = (f"{self.measured_tok_s:,.0f} tok/s from {self.measured_from} (model: {self.time.tok_s:,.0f})"
                 if self.measured_tok_s
                 else f"predicted {self.time.tok_s:,.0f} tok/s, {self.time.mfu_pct:.1f}% MFU")
        return f"{what}: {speed}, peak {self.memory.total / GIB:.2f} GiB predicted"


def _stage_counts(args, layout: Layout, base: Switches) -> list[int]:
    """The head-stage counts the heads take at this layout (``staged_attention.check_head_stages``); the config's
    own only where staging is refused whatever the count (tp, LoRA, attention sinks: ``layout_checks.py``)."""
    from titan_ulysses.distributed.staged_attention import check_head_stages

    if layout.tp > 1 or base.lora_rank or getattr(args, "attn_sinks", False) or args.moe is not None:
        return [base.head_stages]
    counts = []
    for g in sorted({1, 2, 4, 8, base.head_stages}):
        try:
            check_head_stages(g, args.n_heads, args.n_kv_heads, layout.sp, layout.tp)
        except ValueError:
            continue
        counts.append(g)
    return counts


def _overrides(base: Switches, s: Switches) -> list[str]:
    flags = []
    if s.ac_mode != base.ac_mode:
        flags.append(f"--activation_checkpoint.mode {s.ac_mode}")
    if s.head_stages != base.head_stages:
        flags.append(f"--parallelism.ulysses_head_stages {s.head_stages}")
    if s.mlp_tile_size != base.mlp_tile_size:
        flags.append(f"--model.mlp_tile_size {s.mlp_tile_size}")
    if s.loss_chunk_size != base.loss_chunk_size:
        flags.append(f"--model.loss_chunk_size {s.loss_chunk_size}")
    if s.cpu_offload != base.cpu_offload:
        flags.append(f"--training.enable_cpu_offload {str(s.cpu_offload).lower()}")
    return flags


def candidates(args, layout: Layout, base: Switches) -> list[Switches]:
    """Every combination the search weighs (the head-stage counts the heads take)."""
    stages = _stage_counts(args, layout, base)
    tiles = sorted({base.mlp_tile_size, 0, TILE}) if args.moe is None else [0]
    chunks = sorted({base.loss_chunk_size, CHUNK})
    out = []
    for ac, g, tile, chunk, off in itertools.product(AC_MODES, stages, tiles, chunks, (base.cpu_offload,)):
        out.append(dataclasses.replace(base, ac_mode=ac, head_stages=g, mlp_tile_size=tile, loss_chunk_size=chunk,
                                       cpu_offload=off))
    return out


def fastest(args, layout: Layout, base: Switches, seq_len: int, local_batch: int, rates: DeviceRates,
            device_bytes: float, compiled: bool = True, simulated: bool = False, precision: str = "bf16",
            attention: str = "cudnn") -> Choice | None:
    """The fastest switches at this layout whose predicted peak fits ``BUDGET`` of ``device_bytes``; None: none fits."""
    fits: list[Choice] = []
    for s in candidates(args, layout, base):
        mem = predicted(args, layout, s, seq_len, local_batch, compiled, rates.device)
        if mem.total > BUDGET * device_bytes:
            continue
        t = step_time(args, layout, s, seq_len, rates, local_batch, compiled, precision, attention, simulated)
        cell = measured_cell(args, layout, s, seq_len, local_batch, compiled, rates.device)
        seen, source = None, ""
        if cell is not None and cell.device == rates.device and cell.precision == precision and \
                cell.attention == attention:
            # a simulated cell measured the compute alone: the model's traffic is added for a real run
            traffic = 0.0 if simulated or not cell.simulated else sum(
                v for k, v in t.parts.items() if k in TRAFFIC)
            seen = t.tokens / (t.tokens / cell.tok_s + traffic)
            source = f"the measured cell {cell.name} ({cell.device}, {cell.date})" + (
                ", a simulated rank, plus the modelled traffic" if traffic else "")
        fits.append(Choice(s, _overrides(base, s), mem, t, seen, source if seen else ""))
    if not fits and not base.cpu_offload:
        # FSDP CPU offload (its optimizer step on the host, which the model does not time) only where nothing
        # fits without it, as recommend.py
        found = fastest(args, layout, dataclasses.replace(base, cpu_offload=True), seq_len, local_batch, rates,
                        device_bytes, compiled, simulated, precision, attention)
        if found is not None:
            found.overrides = _overrides(base, found.switches)
        return found
    if not fits:
        return None
    # the fewest changes first among equals: fewer switches from the config, then less memory
    fits.sort(key=lambda c: (-c.tok_s, len(c.overrides), c.memory.total))
    best = fits[0]
    measured = [c for c in fits if c.memory.cell is not None]  # a cell measured this step (its peak, its speed)
    if best.memory.cell is None and measured and best.tok_s <= measured[0].tok_s * (1 + UNMEASURED_MARGIN):
        return measured[0]
    return best
