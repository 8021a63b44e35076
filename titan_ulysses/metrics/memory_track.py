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
precision of FSDP, Ulysses, cp, tp and every AC mode but ``full_offload``.
What CPU cannot see (not in the numbers): CUDA kernels' workspaces (cuBLAS, the flash /
cuDNN attention backward's fp32 dq accumulator and, for GQA, its dk/dv expanded to the q
heads), NCCL buffers, the caching allocator's rounding and fragmentation, and
torch.compile's buffers (the step runs eagerly). CPU kernels differ from CUDA ones where
``ops/attention.py`` says so (cp's lower-right mask is a dense ``[Lq, Lk]`` boolean on CPU).
Host and device memory are one here, so FSDP CPU offload and ``full_offload`` are refused.
One artefact of the tracker itself: its wrapper of FSDP's post-backward keeps the last
parameter's unsharded gradient referenced through the reduce-scatter; for the root that is
the output weight (untied), so in a world of one, where the root's reduce-scatter is the
step's peak, the tracker counts ``a V D`` bytes more than a real step holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from titan_ulysses.metrics.memory_estimate import Layout, Switches
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
    """The tracker's peak over the whole step (bytes)."""
    phases: dict[str, Phase]
    """Phase name -> its peak, in the order the step runs them."""

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


class _PhasePeaks(TorchDispatchMode):
    """After each op, the tracker's current total; the largest per phase (entered inside the tracker)."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker
        self.phase = "forward"
        self.phases: dict[str, Phase] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # as the tracker: let DTensor desugar to local ops first
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.record()
        return out

    def record(self) -> None:
        snap = self.tracker.get_tracker_snapshot()
        total = sum(dev.get(TOTAL, 0) for dev in snap.values())
        phase = self.phases.setdefault(self.phase, Phase(self.phase, -1))
        if total > phase.peak:
            kinds: dict[str, int] = {}
            for dev in snap.values():
                for kind, value in dev.items():
                    if kind != TOTAL:
                        key = str(getattr(kind, "value", kind))
                        kinds[key] = kinds.get(key, 0) + value
            phase.peak, phase.kinds = total, kinds


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


def track_step(args: LlamaArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1) -> StepMemory:
    """The memory of rank 0 over a steady-state step (the optimizer state exists, gradients do not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from titan_ulysses.data.sharding import shard_batch
    from titan_ulysses.distributed.lora import LoRAOptions
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.distributed.utils import clip_grad_norm_
    from titan_ulysses.models.llama.parallelize import ParallelizeOptions
    from titan_ulysses.models.registry import build_model, parallelize_model
    from titan_ulysses.optim import build_optimizer

    if switches.cpu_offload or switches.ac_mode == "full_offload":
        raise ValueError("the CPU tracker cannot tell host from device memory: no cpu_offload or full_offload")
    world = layout.dp_shard * layout.cp * layout.sp * layout.tp
    dtype = torch.bfloat16 if switches.act_bytes == 2 else torch.float32
    compute = _compute(switches)
    with _fake_world(world), cuda_kernel_choices():
        pd = ParallelDims(dp_shard=layout.dp_shard, cp=layout.cp, sp=layout.sp, tp=layout.tp, world_size=world)
        pd.build_mesh("cpu")
        with torch.device("meta"):
            model = build_model(args, compute)
        lora = LoRAOptions(rank=switches.lora_rank) if switches.lora_rank else None
        parallelize_model(model, pd, ParallelizeOptions(ac_mode=switches.ac_mode, param_dtype=dtype, lora=lora))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.init_buffers(torch.device("cpu"))
            optimizer = build_optimizer(model, "AdamW", 1e-4, 0.1, 1e-8, (0.9, 0.95), "cuda")  # fused, as on CUDA
            tokens = torch.zeros(local_batch, seq_len, dtype=torch.long)
            batches = [shard_batch(tokens, tokens, 0, layout.sp, cp=layout.cp) for _ in range(switches.microbatches)]

            def step(poller=None, tracker=None):
                for i, mb in enumerate(batches):
                    if i and hasattr(tracker, "reset_mod_stats"):
                        tracker.reset_mod_stats()  # FSDPMemTracker refuses a second forward otherwise
                    if poller is not None:
                        poller.phase = "forward"
                    loss = model(mb.tokens, positions=mb.positions, labels=mb.labels) / 1000.0
                    if poller is not None:
                        poller.phase = "loss backward"
                    loss.backward()
                if poller is not None:
                    poller.phase = "clip grad norm"
                clip_grad_norm_(model.parameters(), 1.0)
                if poller is not None:
                    poller.phase = "optimizer step"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()  # the first step creates the optimizer state
            if isinstance(model, FSDPModule):
                tracker = FSDPMemTracker(model, optimizer)
            else:
                tracker = MemTracker()
                tracker.track_external(model, optimizer)
            with tracker:
                if hasattr(tracker, "track_inputs"):
                    tracker.track_inputs(tuple((mb.tokens, mb.labels, mb.positions) for mb in batches))
                poller = _PhasePeaks(tracker)
                handles = _phase_hooks(model, poller)
                try:
                    with poller:
                        step(poller, tracker)
                finally:
                    for h in handles:
                        h.remove()
            peak = sum(dev.get(TOTAL, 0) for dev in tracker.get_tracker_snapshot("peak").values())
    return StepMemory(peak=peak, phases=poller.phases)


def _compute(switches: Switches):
    from titan_ulysses.models.compute import ComputeOptions

    # sdpa: the one backend that trains on CPU (flash_attn is CUDA-only, flex has no CPU backward)
    return ComputeOptions(loss_chunk_size=switches.loss_chunk_size, mlp_tile_size=switches.mlp_tile_size,
                          attn_backend="sdpa")
