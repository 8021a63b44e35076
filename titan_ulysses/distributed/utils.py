"""The collectives of a step: ``dist_sum`` over a mesh, the gradient norm over every mesh
(``clip_grad_norm_``), and loading full weights into a parallelized model. The loss convention and
``forward_backward`` that use them are ``titan_ulysses/step.py``'s."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh


def dist_sum(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of ``value`` over the ranks of a 1-D mesh (a new tensor; the input is untouched)."""
    out = value.detach().clone()
    if mesh.size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return out


def load_full_state_dict(model: nn.Module, full_state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load unsharded weights (the same on every rank) into a parallelized model.

    Names are those of the plain model; wrappers from AC and compile are looked through.
    ``strict=False`` leaves parameters the dict lacks as they are (LoRA adapters).
    """
    # a copy: set_model_state_dict replaces the dict's values by the sharded tensors it made
    set_model_state_dict(model, dict(full_state_dict), options=StateDictOptions(full_state_dict=True, strict=strict))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip by the total gradient norm over every shard on every mesh; returns that norm.

    Parameters live on different meshes (FSDP-only ones on ``fsdp``, TP ones on
    ``fsdp x tp``), so norms are computed per mesh, completed over it, then combined.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for g in grads:
        key = g.device_mesh if isinstance(g, DTensor) else None
        by_mesh.setdefault(key, []).append(g)
    squares = []
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in by_mesh.values():  # one foreach per mesh: DTensor ops cannot mix meshes
            torch._foreach_mul_(group, coef)
    return total
