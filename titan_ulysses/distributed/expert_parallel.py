"""Expert parallelism: experts sharded over the ``ep`` ranks, tokens sent to the ranks that hold them.

``ep`` borrows its ranks from the innermost of ``dp_shard x cp x sp`` (``parallel_dims.py``):
the ranks of one ep group hold different tokens (other sequences, or other slices of one)
and different experts. Each MoE layer's router runs on the local tokens; the rows sorted by
expert (``models/moe/feed_forward.py``) then go to their experts' ranks in one all-to-all
with uneven splits, come back the same way, and the router's weights combine them locally.
Both exchanges are functional collectives with autograd (the backward of each is the other).
The split sizes are host values: one small all-to-all of the per-expert counts, then a sync.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_ulysses.ops.routed_experts import RoutedExperts

__all__ = ["ExpertParallel", "apply_ep"]


def _local(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if p is None:
        return None
    p = p.to_local() if isinstance(p, DTensor) else p
    return p.to(dtype)  # FSDP leaves expert weights it does not manage in their stored dtype


class ExpertParallel:
    """Mixin put in front of a ``RoutedExperts`` class (``ops/routed_experts.py``) by :func:`apply_ep`
    (parameter names unchanged, so checkpoints reshard across ep degrees): ``(rows [T*k, D] sorted by
    global expert, counts [E]) -> rows``, computing this rank's experts only through its ``run``."""

    ep_group = None
    ep: int = 1
    num_global_experts: int = 0

    @staticmethod
    def split_sizes(send: torch.Tensor, recv: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        """The all-to-all's split sizes on the host (a sync): rows this rank sends to each ep rank, rows it
        receives from each. ``rows`` (all it sends) is for a caller that cannot read the counts: the memory
        tracker, under fake tensors, splits them evenly (``planning/fake_step.py``)."""
        return send.sum(1).tolist(), recv.sum(1).tolist()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local_e = self.ep, self.num_global_experts // self.ep
        send = counts.view(ep, local_e)  # [ep(dst), E_l]: my rows for each expert of rank dst
        recv = funcol.all_to_all_single(send.reshape(-1), None, None, self.ep_group)
        recv = funcol.wait_tensor(recv).view(ep, local_e)  # [ep(src), E_l]: rows each rank sends my experts
        in_splits, out_splits = self.split_sizes(send, recv, x.shape[0])
        got = funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.ep_group)  # [R, D] source-major
        # source-major blocks (src, expert) -> expert-major rows, each block's order kept
        key = torch.arange(local_e, device=x.device)[None, :] * ep + torch.arange(ep, device=x.device)[:, None]
        row_key = torch.repeat_interleave(key.reshape(-1), recv.reshape(-1), output_size=got.shape[0])  # [R]
        order = torch.argsort(row_key, stable=True)  # [R]
        w = [_local(p, x.dtype) for p in self.expert_weights()]
        out = self.run(got[order], recv.sum(0), *w)  # [R, D] expert-major
        back = torch.zeros_like(out).index_copy(0, order, out)  # [R, D] source-major again
        return funcol.all_to_all_single_autograd(back, in_splits, out_splits, self.ep_group)  # [T*k, D]


@functools.lru_cache(maxsize=None)
def _ep_class(cls: type) -> type:
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shard every MoE layer's experts over ``ep_mesh`` (``Shard(0)``: expert e on rank e // (E / ep)) and
    send rows there. Run before FSDP. Returns how many layers it changed."""
    ep, n = ep_mesh.size(), 0
    for experts in model.modules():
        if not isinstance(experts, RoutedExperts) or isinstance(experts, ExpertParallel):
            continue
        total = experts.num_experts
        if total % ep:
            raise ValueError(f"parallelism.expert_parallel_degree {ep} does not divide the {total} experts; "
                             f"use a divisor of {total}")
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]),
                                                          requires_grad=p.requires_grad))
        experts.__class__ = _ep_class(type(experts))
        experts.ep_group, experts.ep, experts.num_global_experts = ep_mesh.get_group(), ep, total
        n += 1
    return n
