"""A traced step's memory, phase by phase: what the tracker's snapshot holds after every op.

``PhasePeaks`` is a dispatch mode that reads ``FSDPMemTracker``'s current snapshot after each op and keeps
its largest per phase (and, keyed, per event: ``extrapolate.py``); ``phase_hooks`` names the phases from the
model's own boundaries. docs/memory_model.md, "How the tracker checks it".
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ulysses.planning.fake_step import HOST

TOTAL = "Total"


@dataclass
class Phase:
    name: str
    peak: int
    """Bytes at the phase's peak."""
    kinds: dict[str, int] = field(default_factory=dict)
    """The tracker's categories at that peak (bytes)."""


@dataclass
class StepMemory:
    peak: int
    """The device peak over the whole step (bytes)."""
    phases: dict[str, Phase]
    """Phase name -> its device peak, in the order the step runs them."""
    host_peak: int = 0
    """Host memory at its peak over the step (bytes): full_offload's block inputs; with FSDP CPU offload,
    the sharded parameters, gradients and optimizer state."""
    traced: str = ""
    """What was traced to get these numbers (depths and lengths; extrapolated or not)."""
    events: dict[str, dict[tuple, list]] | None = None
    """With a keyed trace: phase -> event -> [device bytes, kinds, host bytes] at the event's largest."""
    thresholds: list[str] = field(default_factory=list)
    """Size thresholds that a tensor of this (sample) length is under and would pass at the target length."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases.values(), key=lambda p: p.peak).name

    def summary(self) -> dict[str, Phase]:
        """The phases, with the layers' backward reduced to the busiest one (``layer backward``)."""
        out: dict[str, Phase] = {}
        for name, phase in self.phases.items():
            key = "layer backward" if name.startswith("layer ") else name
            if key not in out or phase.peak > out[key].peak:
                out[key] = Phase(name if key != name else key, phase.peak, phase.kinds)
        return out


CPU_OFFLOAD_KINDS = ("Sharded Param", "Sharded Grad", "OptState")
"""The tracker's kinds FSDP CPU offload keeps in host memory."""


class PhasePeaks(TorchDispatchMode):
    """After each op, the tracker's current device and host totals; the device's largest per phase.

    With ``keyed`` also the largest per phase and *event*: the op, the innermost line of this
    project's code that ran it, the autograd node running (in backward) and the modules active
    (``extrapolate.py`` extrapolates each event in tokens, then takes the phase's largest)."""

    def __init__(self, tracker, host_kinds: tuple[str, ...] = (), keyed: bool = False):
        super().__init__()
        self.tracker = tracker
        self.host_kinds = host_kinds
        self.phase = "forward"
        self.phases: dict[str, Phase] = {}
        self.host_peak = 0
        self.events: dict[str, dict[tuple, list]] | None = {} if keyed else None
        self.forward_nodes = (0, 0)
        """The autograd sequence numbers of the step's forward: [first, last + 1)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # as the tracker: let DTensor desugar to local ops first
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.record(func)
        return out

    def _event(self, func) -> tuple:
        frame, lines = sys._getframe(2), []
        while frame is not None and len(lines) < _EVENT_FRAMES:
            name = frame.f_code.co_filename
            if _PROJECT in name:
                where = name[name.index(_PROJECT) + len(_PROJECT):]
                if not where.startswith(_OWN):
                    lines.append(f"{where}:{frame.f_lineno}")
            frame = frame.f_back
        line = " < ".join(lines)
        node = torch._C._current_autograd_node()
        if node is not None:  # a node of the forward by its place in it; one made in backward (a tile's
            seq = node._sequence_nr()  # recompute) by its name: the same in every tile
            node = (node.name(), seq - self.forward_nodes[0]) if seq < self.forward_nodes[1] else node.name()
        parents = getattr(getattr(self.tracker, "_mod_tracker", None), "parents", ())
        return str(func), line, node, frozenset(parents)

    def record(self, func=None) -> None:
        # the tracker's own current snapshot, read without the deep copy get_tracker_snapshot() makes
        # (a third of the step's time: it runs after every op); only read here
        snap = getattr(self.tracker, "_curr_mem_snap", None)
        if snap is None:
            snap = self.tracker.get_tracker_snapshot()
        kinds: dict[str, int] = {}
        host = 0
        for dev, by_kind in snap.items():
            for kind, value in by_kind.items():
                if kind == TOTAL:
                    continue
                key = str(getattr(kind, "value", kind))
                if torch.device(dev).type == HOST.type or key in self.host_kinds:
                    host += value
                else:
                    kinds[key] = kinds.get(key, 0) + value
        total = sum(kinds.values())
        self.host_peak = max(self.host_peak, host)
        phase = self.phases.setdefault(self.phase, Phase(self.phase, -1))
        if total > phase.peak:
            phase.peak, phase.kinds = total, kinds
        if self.events is not None and func is not None:
            event = self.events.setdefault(self.phase, {}).setdefault(self._event(func), [-1, {}, 0])
            if total > event[0]:
                event[0], event[1] = total, kinds
            event[2] = max(event[2], host)


_PROJECT = "titan_ulysses" + os.sep
_OWN = "planning" + os.sep
"""The tracker's own frames (the dispatch mode, the step, the patches) name no event."""
_EVENT_FRAMES = 3
"""Lines of this project's code (innermost first) that name an event: ``upcast`` alone serves the norm and the loss."""


def phase_hooks(model, poller: PhasePeaks) -> list:
    """Name the phases from the model's own boundaries: the final norm starts the loss; in
    backward, the gradient of each block's output starts that block's backward."""
    blocks = list(model.layers.values())

    def on_grad(name):
        def hook(grad):
            poller.phase = name
        return hook

    def block_output(i):
        def hook(module, inputs, output):
            output = output[0] if isinstance(output, tuple) else output  # (h, a mixture of experts' statistics)
            if poller.phase == "forward" and output.requires_grad:  # not the AC recompute in backward
                output.register_hook(on_grad(f"layer {i} backward"))
                if i == 0 and inputs[0].requires_grad:  # a frozen embedding (LoRA) has no backward
                    inputs[0].register_hook(on_grad("embedding backward"))
        return hook

    def loss_start(module, inputs):
        if poller.phase == "forward":
            poller.phase = "loss forward"

    handles = [b.register_forward_hook(block_output(i)) for i, b in enumerate(blocks)]
    handles.append(model.norm.register_forward_pre_hook(loss_start))
    return handles
