"""What a CPU step under fake tensors does differently from a CUDA step, patched for the tracker.

A fake process group (rank 0 of the simulated world), sdpa's and the experts' kernel choices as on CUDA,
full_offload's copies to a fake host device, DTensor's sharding propagation left uncounted, and a mixture of
experts' routing assumed balanced (fake tensors have no values to route by). docs/memory_model.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

HOST = torch.device("cuda")
"""The fake device that stands for host memory in the tracked step."""


@contextlib.contextmanager
def fake_world(world: int):
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
def offload_to_fake_host(offloader: type, token_scale: float = 1.0, crossed: list | None = None):
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
def sharding_metadata_unseen():
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


def _even(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` sizes that differ by at most one, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@contextlib.contextmanager
def balanced_experts():
    """A mixture of experts routed evenly: every expert gets ``T k / E`` of a rank's ``T k`` rows and every
    ep rank ``T k / ep`` of them, in both directions of the dispatch. Fake tensors have no values, so the
    host syncs that read the routing (expert parallelism's split sizes, the grouped product's loop) cannot
    run; and the grouped product runs its kernel (``torch._grouped_mm``) where an sm90 GPU would: bf16 with
    16-byte aligned rows. A rank that receives more than its share holds proportionally more of the
    dispatch's received rows and the experts' intermediates than this step."""
    from unittest import mock

    from titan_ulysses.distributed.expert_parallel import ExpertParallel
    from titan_ulysses.ops import grouped_mm as gmm

    def split_sizes(send, recv, rows):
        sizes = _even(rows, send.shape[0])
        return sizes, list(sizes)

    def available(x, w):
        return x.dtype == w.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0

    def loop(x, w, counts):
        parts = torch.split(x, _even(x.shape[0], w.shape[0]), dim=0)
        return torch.cat([p @ w[g] for g, p in enumerate(parts)], dim=0)

    with mock.patch.object(ExpertParallel, "split_sizes", staticmethod(split_sizes)), \
            mock.patch.object(gmm, "grouped_mm_available", available), mock.patch.object(gmm, "grouped_mm_loop", loop):
        yield
