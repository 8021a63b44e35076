"""Host offload of what each checkpointed block keeps for backward (``full_offload``).

Under full activation checkpointing a block keeps only its input ``[B, S/sp, D]`` (plus
the shared RoPE tables), and even that adds up: Llama-3-8B at 1M tokens over sp=8 keeps
32 x 1 GiB in bf16. This moves those tensors to pinned host memory and back, overlapped
with compute on CUDA:

* forward: each block's saved tensors are copied device -> host (in pieces the pinned
  allocator does not round up to a power of two: ``host_copy.py``) on a side stream that
  waits only for the work that produced them; the compute stream runs on, and the
  allocator is told (``record_stream``) not to reuse the device memory before the copy
  has read it.
* backward: blocks are unpacked in reverse order. Unpacking block i waits for its own
  host -> device copy (issued earlier) and issues the copy of block i-1's tensors on the
  side stream, so that it travels while block i recomputes and backpropagates.

A tensor whose storage an earlier block of the same forward already saved (the RoPE
tables every block shares) stays on the device instead of travelling once per block;
tensors smaller than ``min_bytes`` stay too. On a CPU-only run nothing moves (there is no
host memory to move to): the hooks are still installed, so numerics are those of ``full``.

Under activation checkpointing in groups of layers (``activation_checkpoint.py``'s
``CheckpointGroups``) the unit is a group instead of a block: the hooks are entered around
each group's forward, where only the group's input is saved (its blocks' inputs are the
group checkpoint's to recompute), so exactly the group inputs travel.

The hooks sit on the outermost module of each block (or around each group), outside any compiled region
(``torch.compile`` cannot trace saved-tensor hooks), so :func:`apply_activation_offload`
runs after ``apply_compile``. A compiled block's autograd function saves what its graph keeps --
the block's input, its weights (graph inputs), the few tensors the partitioner chose -- and the hooks
apply to each when the block runs: the input travels as in eager, the weights stay (``_pack``).
Each open unit is kept in the offloader, keyed by the block: a compiled block forwards attribute
writes to the module it wraps, so a unit stored on the block was never closed and its hooks packed
everything after it (the loss, the next steps' forwards; issue 39).
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from titan_ulysses.distributed.activation_checkpoint import CheckpointGroups
from titan_ulysses.distributed.host_copy import HostCopy


class _Group:
    """What one block's forward saved, moved as a unit."""

    def __init__(self, prev: _Group | None):
        self.prev = prev  # the block before it: what backward unpacks next
        self.entries: list[_Entry] = []
        self.loaded = False
        self.ready: torch.cuda.Event | None = None  # host -> device copy done (CUDA)
        self.prefetched = False  # loaded ahead of its first unpack


class _Entry:
    def __init__(self, group: _Group, host: torch.Tensor | HostCopy, device: torch.device):
        self.group, self.host, self.device = group, host, device
        self.restored: torch.Tensor | None = None
        self.uses = 1  # saved tensors packed as this entry, each unpacked once; the last unpack lets go of it


class ActivationOffloader:
    """Saved-tensor hooks for every block of one model; state is per forward pass."""

    def __init__(self, min_bytes: int = 1 << 20):
        self.min_bytes = min_bytes
        self._stream: torch.cuda.Stream | None = None
        self._last: _Group | None = None
        # storage pointer -> (the tensor, weakly; its entry, or None where it stays on the device)
        self._seen: dict[int, tuple[weakref.ref, _Entry | None]] = {}
        self.offloaded_bytes = 0  # sent to the host by the last forward (the metrics' host_offload_gib)
        # id(block) -> its open unit: kept here, not on the block, since a compiled block
        # (``OptimizedModule``) sets attributes on the module it wraps but reads its own __dict__
        self._open: dict[int, contextlib.AbstractContextManager] = {}

    # -- hooks ----------------------------------------------------------------------------
    def start_forward(self, module, args) -> None:
        """Root pre-hook: a new forward starts a new chain of blocks."""
        self._last, self._seen, self.offloaded_bytes = None, {}, 0

    def enter_block(self, module, args) -> None:
        ctx = self.unit()
        ctx.__enter__()
        self._open[id(module)] = ctx

    @contextlib.contextmanager
    def unit(self):
        """One block's (or group's) forward: what it saves moves as one ``_Group``."""
        group = _Group(self._last)
        self._last = group
        with saved_tensors_hooks(functools.partial(self._pack, group), self._unpack):
            yield

    def exit_block(self, module, args, output) -> None:
        ctx = self._open.pop(id(module), None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # -- pack / unpack --------------------------------------------------------------------
    def offloadable(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes to the host: device tensors of at least ``min_bytes``."""
        return t.device.type != "cpu" and t.numel() * t.element_size() >= self.min_bytes

    def _pack(self, group: _Group, t: torch.Tensor):
        # a parameter stays: it lives on the device anyway (or FSDP gathers it again for backward), and a
        # host copy would come back as a second device copy beside it. Eager blocks save none here (the
        # checkpoint keeps only the block's inputs); a compiled block saves its weights as graph inputs.
        if isinstance(t, nn.Parameter) or not self.offloadable(t):
            return t
        key = t.untyped_storage().data_ptr()
        ref, earlier = self._seen.get(key, (None, None))
        if ref is not None and ref() is not None:  # the same live storage was saved before
            if earlier is not None and earlier.group is group:
                earlier.uses += 1
                return earlier
            self._seen[key] = (ref, None)  # shared across blocks: one device copy serves them all
            return t
        # (a dead reference means the storage was freed and its address reused)
        entry = _Entry(group, self._to_host(t), t.device)
        self.offloaded_bytes += t.numel() * t.element_size()
        group.entries.append(entry)
        self._seen[key] = (weakref.ref(t), entry)
        return entry

    def _unpack(self, packed):
        if not isinstance(packed, _Entry):
            return packed
        group = packed.group
        if not group.loaded:
            self._load(group, ahead=False)
        if group.ready is not None:
            stream = torch.cuda.current_stream(packed.device)
            stream.wait_event(group.ready)
            packed.restored.record_stream(stream)  # allocated on the side stream, used here
        if group.prev is not None and not group.prev.loaded:
            self._load(group.prev, ahead=True)  # travels while this block runs its backward
        restored = packed.restored
        packed.uses -= 1
        if packed.uses == 0:  # the entry outlives the backward (``_seen`` until the next forward): not its copy
            packed.restored = None
        return restored

    # -- copies ---------------------------------------------------------------------------
    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        stream = self._side_stream(t.device)
        if stream is None:
            return t.detach().to("cpu", copy=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t has been computed
        with torch.cuda.stream(stream):
            host = HostCopy(t, pin=True)  # pieces the pinned allocator does not round up (host_copy.py)
        t.record_stream(stream)  # its memory is not reused before the copy has read it
        return host

    def _load(self, group: _Group, ahead: bool) -> None:
        group.loaded, group.prefetched = True, ahead
        if not group.entries:
            return
        stream = self._side_stream(group.entries[0].device)
        if stream is None:
            for e in group.entries:
                e.restored, e.host = e.host.to(e.device, copy=True), None
            return
        with torch.cuda.stream(stream):  # after this group's device -> host copies (same stream)
            for e in group.entries:  # the host allocator keeps each buffer until its copy is done
                e.restored, e.host = e.host.restore(non_blocking=True), None
            group.ready = torch.cuda.Event()
            group.ready.record(stream)


def apply_activation_offload(model: nn.Module, min_bytes: int = 1 << 20) -> ActivationOffloader:
    """Send what each block of ``model.layers`` saves for backward to host memory.

    Call it after ``apply_ac(model, "full_offload")`` and after ``apply_compile``.
    """
    offloader = ActivationOffloader(min_bytes)
    model.register_forward_pre_hook(offloader.start_forward)
    runner = getattr(model, "layer_units", None)
    if isinstance(runner, CheckpointGroups):  # groups of layers: the group is the unit
        runner.around_group = offloader.unit
    else:
        for block in model.layers.children():
            block.register_forward_pre_hook(offloader.enter_block)
            block.register_forward_hook(offloader.exit_block, always_call=True)
    model.activation_offloader = offloader  # read by metrics/system.py
    return offloader
