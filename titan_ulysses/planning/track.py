"""One training step's memory, measured phase by phase on CPU without computing anything.

``track_step`` builds the model as the trainer does (meta device, the family's parallelize,
FSDP2 over the simulated layout), joins PyTorch's fake process group as rank 0 of the
simulated world, and runs a steady-state step -- forward with the (chunked) loss, backward,
gradient clipping, the AdamW step, ``zero_grad(set_to_none=True)`` -- under
``FakeTensorMode``, so that Llama-3-8B at 128K tokens costs seconds and no memory.
PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``) follows every
storage and sorts it by kind (sharded and unsharded parameters and gradients, all-gather and
reduce-scatter buffers, optimizer state, activations, backward temporaries); ``_PhasePeaks``
below only reads the tracker's current snapshot after each op and keeps its maximum per phase
of the step (forward, loss forward, loss backward, each layer's backward, the embeddings'
backward with the root's reduce-scatter, clipping, the optimizer step).

What it mirrors: ``Trainer.train_step`` (which cannot run under fake tensors: it reads the
loss with ``.item()``), the fused AdamW the trainer builds on CUDA, the bf16/fp32 mixed
precision of FSDP, Ulysses (head-staged too), cp, tp and every AC mode.
What CPU cannot see (not in the numbers): CUDA kernels' workspaces (cuBLAS, the flash /
cuDNN attention backward's fp32 dq accumulator and, for GQA, its dk/dv expanded to the q
heads), NCCL buffers, the caching allocator's rounding and fragmentation, and
torch.compile's buffers (the step runs eagerly). CPU kernels differ from CUDA ones where
``ops/attention.py`` says so (cp's lower-right mask is a dense ``[Lq, Lk]`` boolean on CPU).
Host and device: the step runs on the fake ``cpu`` device, and what goes to host memory is
put on a fake ``cuda`` device instead (the tracker only needs the two to differ):
``full_offload``'s block inputs (``activation_offload.py``'s copies, patched here). FSDP
CPU offload cannot be faked so (FSDP2 needs the device's streams), so the step runs without
it and counts FSDP's sharded parameters and gradients and the optimizer state as host memory
(FSDP keeps exactly those on the host; their transient device copies, one block's shard in
an all-gather or reduce-scatter, are not counted).

Cost: every op is a Python call into the tracker, so the time grows with the layers and with
the tokens over the chunk sizes. ``track_extrapolation.py`` says which steps are traced (three and
four layers, or groups of checkpointed layers; short lengths, each event's bytes extrapolated
affinely in the tokens, checked on a third length, else the full length) and why that is exact;
``StepMemory.traced`` says what was.
DTensor's sharding propagation runs ops on fake tensors of the global shapes to learn output
shapes; that is not counted (``_sharding_metadata_unseen``).
One artefact of the tracker itself: its wrapper of FSDP's post-backward keeps the last
parameter's unsharded gradient referenced through the reduce-scatter; for the root that is
the output weight (untied), so in a world of one, where the root's reduce-scatter is the
step's peak, the tracker counts ``a V D`` bytes more than a real step holds.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.models.llama.args import LlamaArgs

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


HOST = torch.device("cuda")
"""The fake device that stands for host memory in the tracked step."""
CPU_OFFLOAD_KINDS = ("Sharded Param", "Sharded Grad", "OptState")
"""The tracker's kinds FSDP CPU offload keeps in host memory."""


class _PhasePeaks(TorchDispatchMode):
    """After each op, the tracker's current device and host totals; the device's largest per phase.

    With ``keyed`` also the largest per phase and *event*: the op, the innermost line of this
    project's code that ran it, the autograd node running (in backward) and the modules active
    (``track_extrapolation.py`` extrapolates each event in tokens, then takes the phase's largest)."""

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
            if _PROJECT in name and not name.endswith(os.path.join("planning", "track.py")):
                lines.append(f"{name[name.index(_PROJECT) + len(_PROJECT):]}:{frame.f_lineno}")
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
_EVENT_FRAMES = 3
"""Lines of this project's code (innermost first) that name an event: ``upcast`` alone serves the norm and the loss."""


def _phase_hooks(model, poller: _PhasePeaks) -> list:
    """Name the phases from the model's own boundaries: the final norm starts the loss; in
    backward, the gradient of each block's output starts that block's backward."""
    blocks = list(model.layers.values())

    def on_grad(name):
        def hook(grad):
            poller.phase = name
        return hook

    def block_output(i):
        def hook(module, inputs, output):
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


@contextlib.contextmanager
def _fake_world(world: int):
    """Rank 0 of ``world`` on PyTorch's fake process group (the trainer's ``comm.mode = "fake"``)."""
    if dist.is_initialized():
        raise RuntimeError("track_step needs its own fake process group; a process group is already initialized")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def cuda_kernel_choices():
    """Let ``ops/attention/sdpa.py`` choose its kernels as on CUDA (fake tensors run any kernel's meta
    function on any device): cp's lower-right causal attention takes the flash kernel in bf16
    (on CPU it builds a dense ``[Lq, Lk]`` mask and sdpa a bf16 copy of it, 12 GiB per chunk
    at 128K over cp 2), and GQA expands its kv heads for the kernels that need it."""
    from unittest import mock

    from titan_ulysses.ops.attention import sdpa as attention

    half = (torch.bfloat16, torch.float16)

    def flash_lower_right(q):
        return q.dtype in half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256

    def needs_kv_expanded(q, k, dense_mask):
        return q.shape[2] != k.shape[2] and (dense_mask or q.dtype not in half)

    with mock.patch.object(attention, "_flash_lower_right", flash_lower_right), \
            mock.patch.object(attention, "_cuda_needs_kv_expanded", needs_kv_expanded):
        yield


@contextlib.contextmanager
def _offload_to_fake_host(offloader: type, token_scale: float = 1.0, crossed: list | None = None):
    """``full_offload``'s copies go to the fake host device: what the offloader sends off a CUDA device
    (its tensors of at least ``min_bytes``) leaves the tracked step's device here. ``token_scale``:
    the target length over the traced one; a tensor under ``min_bytes`` that would reach it at the
    target length (if it grows with the tokens) is noted in ``crossed``."""
    from unittest import mock

    def offloadable(self, t):
        size = t.numel() * t.element_size()
        if crossed is not None and t.device.type != HOST.type and size < self.min_bytes <= size * token_scale:
            crossed.append(f"activation offload min_bytes {self.min_bytes}: a {tuple(t.shape)} tensor")
        return t.device.type != HOST.type and size >= self.min_bytes

    def to_host(self, t):  # a fake tensor's contents are nothing to copy (and a copy would need CUDA)
        return torch.empty_like(t, device=HOST)

    with mock.patch.object(offloader, "offloadable", offloadable), mock.patch.object(offloader, "_to_host", to_host):
        yield


@contextlib.contextmanager
def _sharding_metadata_unseen():
    """DTensor's sharding propagation learns an op's output shape by running the op on fake tensors of
    the GLOBAL shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``): in a real step those
    are fake and cost nothing, but under the tracker's ``FakeTensorMode`` they were counted (every
    parameter full-size in fp32 during the clipping's ``_foreach`` ops). Here that propagation runs
    with the tracker's modes off, on a fake mode of its own: nothing it makes is counted."""
    from unittest import mock

    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self, op_schema):
        with _disable_current_modes():  # the propagation makes a fake mode of its own
            return propagate(self, op_schema)

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", unseen):
        yield


def track_step(args: LlamaArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1,
               extrapolate: bool = True) -> StepMemory:
    """The memory of rank 0 over a steady-state step (the optimizer state exists, gradients do not).

    With ``extrapolate``: traced at three and four layers (more than four), or groups of
    ``Switches.ac_layers_per_checkpoint`` layers, and at short lengths (a long one), each phase
    extrapolated to ``args.n_layers`` and ``seq_len`` (``track_extrapolation.py``); ``StepMemory.traced``
    says what was traced."""
    import dataclasses

    from titan_ulysses.planning import extrapolate as ex

    group = switches.ac_layers_per_checkpoint
    depths = ex.tracked_layer_counts(args.n_layers, extrapolate, group)
    lengths, why = ex.sample_lengths(seq_len, layout, switches) if extrapolate else ((seq_len,), "")
    at_depth = {n: dataclasses.replace(args, n_layers=n) for n in depths}
    steps: dict[int, StepMemory] = {}
    if len(lengths) > 1:
        q = ex.token_quantum(layout, switches)
        m = ex.local_tokens(seq_len, layout) // q
        scale = {s: m * q / ex.local_tokens(s, layout) for s in lengths}
        keyed = {(n, s): _track(at_depth[n], layout, switches, s, local_batch, keyed=True, token_scale=scale[s])
                 for n in depths for s in lengths[:2]}
        check = _track(at_depth[depths[-1]], layout, switches, lengths[2], local_batch, keyed=True,
                       token_scale=scale[lengths[2]])
        why = ex.off_the_line(keyed[depths[-1], lengths[0]], keyed[depths[-1], lengths[1]], check) or \
            "".join(ex.off_the_line(keyed[n, lengths[0]], keyed[n, lengths[1]]) for n in depths[:-1])
        if not why:
            steps = {n: ex.at_length(keyed[n, lengths[0]], keyed[n, lengths[1]], m) for n in depths}
            sampled = f"{' and '.join(f'{s:,}' for s in lengths[:2])} tokens (on the line at {lengths[2]:,})"
    if not steps:
        steps = {n: _track(at_depth[n], layout, switches, seq_len, local_batch) for n in depths}
        sampled = f"{seq_len:,} tokens" + (f" (not extrapolated in tokens: {why})" if why else "")
    layers = " and ".join(map(str, depths))
    if len(depths) == 1:
        step = steps[depths[0]]
    else:
        step = ex.to_depth(steps[depths[0]], steps[depths[1]], args.n_layers, group)
    extrapolated = len(depths) > 1 or len(lengths) > 1 and not why
    if group > 1 and len(depths) > 1:
        layers += f" layers (3 and 4 groups of {group}" + \
            (f", the last of {args.n_layers % group})" if args.n_layers % group else ")")
    else:
        layers += " layers"
    step.traced = f"traced at {layers} x {sampled}" + \
        (f", extrapolated to {args.n_layers} layers x {seq_len:,} tokens" if extrapolated else "")
    step.events = None
    return step


def _track(args: LlamaArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1,
           keyed: bool = False, token_scale: float = 1.0) -> StepMemory:
    """One step traced as it is (``keyed``: with the per-event largest; ``token_scale``: the length this
    trace stands for over ``seq_len``, for the size thresholds)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from titan_ulysses.data.sharding import shard_batch
    from titan_ulysses.distributed.lora import LoRAOptions
    from titan_ulysses.distributed.activation_offload import ActivationOffloader
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.distributed.utils import clip_grad_norm_
    from titan_ulysses.models.llama.parallelize import ParallelizeOptions
    from titan_ulysses.models.registry import build_model, parallelize_model
    from titan_ulysses.optim import build_optimizer

    world = layout.dp_shard * layout.cp * layout.sp * layout.tp
    dtype = torch.bfloat16 if switches.act_bytes == 2 else torch.float32
    compute = _compute(switches)
    host_kinds = CPU_OFFLOAD_KINDS if switches.cpu_offload else ()
    crossed: list[str] = []
    with _fake_world(world), cuda_kernel_choices(), _offload_to_fake_host(ActivationOffloader, token_scale, crossed), \
            _sharding_metadata_unseen():
        pd = ParallelDims(dp_shard=layout.dp_shard, cp=layout.cp, sp=layout.sp, tp=layout.tp, world_size=world)
        pd.build_mesh("cpu")
        with torch.device("meta"):
            model = build_model(args, compute)
        lora = LoRAOptions(rank=switches.lora_rank) if switches.lora_rank else None
        parallelize_model(model, pd, ParallelizeOptions(
            ac_mode=switches.ac_mode, ac_layers_per_checkpoint=switches.ac_layers_per_checkpoint, param_dtype=dtype,
            lora=lora, ulysses_head_stages=switches.head_stages,
            ulysses_stage_keep_attention=switches.stage_keep_attention))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.init_buffers(torch.device("cpu"))
            optimizer = build_optimizer(model, "AdamW", 1e-4, 0.1, 1e-8, (0.9, 0.95), "cuda")  # fused, as on CUDA
            tokens = torch.zeros(local_batch, seq_len, dtype=torch.long)
            batches = [shard_batch(tokens, tokens, 0, layout.sp, cp=layout.cp) for _ in range(switches.microbatches)]

            def step(poller, tracker):
                for i, mb in enumerate(batches):
                    if i and hasattr(tracker, "reset_mod_stats"):
                        tracker.reset_mod_stats()  # FSDPMemTracker refuses a second forward otherwise
                    poller.phase = "forward"
                    first = torch._C._autograd._get_sequence_nr()
                    loss = model(mb.tokens, positions=mb.positions, labels=mb.labels) / 1000.0
                    poller.forward_nodes = (first, torch._C._autograd._get_sequence_nr())
                    poller.phase = "loss backward"
                    loss.backward()
                poller.phase = "clip grad norm"
                clip_grad_norm_(model.parameters(), 1.0)
                poller.phase = "optimizer step"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            # the optimizer state of a steady-state step, without running a step to make it
            for p in model.parameters():
                if p.requires_grad:  # a frozen base (LoRA) has no gradient, and the optimizer never clears one
                    p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if isinstance(model, FSDPModule):
                tracker = FSDPMemTracker(model, optimizer)
            else:
                tracker = MemTracker()
                tracker.track_external(model, optimizer)
            with tracker:
                if hasattr(tracker, "track_inputs"):
                    tracker.track_inputs(tuple((mb.tokens, mb.labels, mb.positions) for mb in batches))
                poller = _PhasePeaks(tracker, host_kinds, keyed)
                handles = _phase_hooks(model, poller)
                try:
                    with poller:
                        step(poller, tracker)
                finally:
                    for h in handles:
                        h.remove()
    return StepMemory(peak=max(p.peak for p in poller.phases.values()), phases=poller.phases,
                      host_peak=poller.host_peak, traced=f"{args.n_layers} layers x {seq_len:,} tokens",
                      events=poller.events, thresholds=sorted(set(crossed)))


def _compute(switches: Switches):
    from titan_ulysses.models.compute import ComputeOptions

    # sdpa: the one backend that trains on CPU (flash_attn is CUDA-only, flex has no CPU backward)
    return ComputeOptions(loss_chunk_size=switches.loss_chunk_size, mlp_tile_size=switches.mlp_tile_size,
                          attn_backend="sdpa")
