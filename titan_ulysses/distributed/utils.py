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


def router_aux_share(stats, loss_mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the load-balancing loss of a mixture of experts (``models/moe/aux_loss.py``)
    under the convention above, and the routing counts of every rank ([E], summed over layers).

    The counts and rows are summed over ``loss_mesh`` (every rank's tokens of this forward; one
    all-reduce), the probabilities are this rank's: the shares add up to the single-device loss.
    Unweighted: the objective adds ``aux_loss_coef`` x it."""
    from titan_ulysses.models.moe.aux_loss import load_balancing_loss

    routed = torch.cat([stats.counts.detach().double(), stats.rows.detach().double()[None]])  # [E + 1]
    if loss_mesh.size() > 1:
        dist.all_reduce(routed, group=loss_mesh.get_group())
    counts, rows = routed[:-1].to(stats.prob_sum.dtype), routed[-1].to(stats.prob_sum.dtype)
    return load_balancing_loss(stats, counts, rows), routed[:-1]


class StepLoss(NamedTuple):
    loss: torch.Tensor
    """The global mean language-model loss (0-dim, fp32, on the device; summed over the ``loss``
    mesh, not yet read): comparable with a dense model's and with the held-out loss."""
    tokens: torch.Tensor
    """Loss-carrying tokens of the global batch (0-dim on the device), the mean's denominator."""
    aux: torch.Tensor | None = None
    """Mixture of experts, training only: the load-balancing loss (unweighted, as transformers'
    ``aux_loss``), the mean over the step's forwards; the objective was ``loss + aux_coef * aux``."""
    aux_coef: float = 0.0
    expert_counts: torch.Tensor | None = None
    """[E] fp64: top-k assignments per expert, summed over layers, microbatches and ranks."""


def forward_backward(model: nn.Module, microbatches: list, loss_mesh: DeviceMesh) -> StepLoss:
    """Forward (and backward) of this rank's microbatches of one step, by the convention above.

    ``microbatches``: this rank's ``SPBatch``es (``data/sharding.py``), all of the step's. Each
    one's summed loss is divided by the global token count before its backward, so gradients
    accumulate to those of the global mean. A mixture of experts adds ``aux_loss_coef`` x its
    load-balancing loss per forward, divided by the number of forwards (transformers' loss is per
    forward). Under ``torch.no_grad`` (held-out evaluation) it is the forward of the language-model
    loss alone. Nothing is read back to the host: the caller decides when to look.
    """
    n_tokens = global_token_count([mb.labels for mb in microbatches], loss_mesh)
    n_tokens = n_tokens.to(microbatches[0].labels.device, torch.float32)
    backend = model.compute.attn_backend
    moe = getattr(getattr(model, "args", None), "moe", None) if torch.is_grad_enabled() else None
    coef = moe.aux_loss_coef if moe is not None else 0.0
    total = torch.zeros((), device=n_tokens.device)  # fp32, or the loss's dtype when wider
    aux_total = counts = None
    for mb in microbatches:
        mask = build_attention_mask(backend, mb.document_ids)  # one per microbatch: every layer reuses it
        loss = model(mb.tokens, positions=mb.positions, attention_mask=mask, labels=mb.labels) / n_tokens
        stats, model.router_stats = getattr(model, "router_stats", None), None  # held, it would keep the graph
        objective = loss
        if moe is not None and stats is not None:
            aux, mb_counts = router_aux_share(stats, loss_mesh)
            aux = aux / len(microbatches)
            if coef > 0:
                objective = loss + coef * aux
            aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
            counts = mb_counts if counts is None else counts + mb_counts
        if torch.is_grad_enabled():
            objective.backward()
        total = total + loss.detach()
    if aux_total is None:
        return StepLoss(dist_sum(total, loss_mesh), n_tokens)
    total, aux_total = dist_sum(torch.stack([total, aux_total.to(total.dtype)]), loss_mesh)  # one all-reduce
    return StepLoss(total, n_tokens, aux_total, coef, counts)


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
