"""The step's loss (``forward_backward``), its reductions, and loading full weights into a parallelized model.

The loss convention that makes every layout equal to one device:

    loss_rank = sum of this rank's token losses / number of loss tokens in the whole global batch

where "whole global batch" spans every microbatch of the step and every rank of the
``loss`` mesh (dp_replicate x dp_shard x cp x sp). Summing ``loss_rank`` over ranks gives the
global mean, and so does summing its gradients -- which is what FSDP is set to do
(``set_gradient_divide_factor(1.0)``). Normalising by a per-rank or per-microbatch count
instead is the classic bug that makes loss drift with the SP degree or with accumulation.
:func:`forward_backward` is that convention in code: the trainer's step, the held-out
evaluation and the tests' parallel step all call it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX


def dist_sum(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of ``value`` over the ranks of a 1-D mesh (a new tensor; the input is untouched)."""
    out = value.detach().clone()
    if mesh.size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return out


def global_token_count(labels: list[torch.Tensor], loss_mesh: DeviceMesh, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of non-ignored labels over all microbatches of a step and all ranks of ``loss_mesh``."""
    local = sum((lab != ignore_index).sum() for lab in labels)
    return dist_sum(torch.as_tensor(local, dtype=torch.float64), loss_mesh)


def router_loss_share(stats, loss_mesh: DeviceMesh, coef: float) -> torch.Tensor:
    """This rank's share of ``coef`` x the load-balancing loss of a mixture of experts (``models/moe/aux_loss.py``)
    under the convention above: the routing counts and rows summed over ``loss_mesh`` (every rank's tokens
    of this forward), this rank's probabilities. The shares add up to the single-device loss; with
    microbatches each forward's loss is its own (as transformers' per forward), so divide by their number."""
    from titan_ulysses.models.moe.aux_loss import load_balancing_loss

    counts, rows = stats.counts.detach().clone(), stats.rows.detach().clone()
    if loss_mesh.size() > 1:
        dist.all_reduce(counts, group=loss_mesh.get_group())
        dist.all_reduce(rows, group=loss_mesh.get_group())
    return coef * load_balancing_loss(stats, counts, rows)


class StepLoss(NamedTuple):
    loss: torch.Tensor
    """The global mean loss (0-dim, fp32, on the device; summed over the ``loss`` mesh, not yet read)."""
    tokens: torch.Tensor
    """Loss-carrying tokens of the global batch (0-dim on the device), the mean's denominator."""


def forward_backward(model: nn.Module, microbatches: list, loss_mesh: DeviceMesh) -> StepLoss:
    """Forward (and backward) of this rank's microbatches of one step, by the convention above.

    ``microbatches``: this rank's ``SPBatch``es (``data/sharding.py``), all of the step's. Each
    one's summed loss is divided by the global token count before its backward, so gradients
    accumulate to those of the global mean. Under ``torch.no_grad`` (held-out evaluation) it is
    the forward alone. Nothing is read back to the host: the caller decides when to look.
    """
    n_tokens = global_token_count([mb.labels for mb in microbatches], loss_mesh)
    n_tokens = n_tokens.to(microbatches[0].labels.device, torch.float32)
    backend = model.compute.attn_backend
    total = torch.zeros((), device=n_tokens.device)  # fp32, or the loss's dtype when wider
    for mb in microbatches:
        mask = build_attention_mask(backend, mb.document_ids)  # one per microbatch: every layer reuses it
        loss = model(mb.tokens, positions=mb.positions, attention_mask=mask, labels=mb.labels) / n_tokens
        if torch.is_grad_enabled():
            loss.backward()
        total = total + loss.detach()
    return StepLoss(dist_sum(total, loss_mesh), n_tokens)


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
