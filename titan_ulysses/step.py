"""The step: ``forward_backward`` under the loss convention, and the non-finite guard that decides on the
device whether a step's update reaches the weights (:class:`StepGuard`).

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
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.models.moe.aux_loss import load_balancing_loss
from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX


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
        mask = build_attention_mask(backend, mb.document_ids, mb.spans)  # one per microbatch: every layer reuses it
        loss, stats = model(mb.tokens, positions=mb.positions, attention_mask=mask, labels=mb.labels, return_stats=True)
        loss = loss / n_tokens
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




class GuardValues(NamedTuple):
    """A step's guard as read on the host (:meth:`StepGuard.read`)."""

    loss: float
    """The global mean language-model loss."""
    aux: float
    """The load-balancing loss of a mixture of experts (0 for a dense model)."""
    grad_norm: float
    """The gradient norm (before clipping)."""
    nonfinite: bool
    """Some rank's objective or gradient norm was NaN/inf: the update was (or is to be) skipped."""
    signalled: bool
    """Some rank was signalled (SIGTERM/SIGUSR1): every rank saves this step and stops."""
    logged: tuple[float, ...] = ()
    """The ``extra`` values read in the same transfer (a logging step's counts), in their order."""

    def objective(self, aux_coef: float) -> float:
        """What the step minimised: ``loss + aux_coef * aux``."""
        return self.loss + (aux_coef * self.aux if aux_coef else 0.0)


class StepGuard:
    """Whether one step's update may reach the weights, decided on the device; read on the host later.

    A step is non-finite when its objective (loss + aux_coef x aux) or its gradient norm is NaN/inf.
    That flag and "some rank was signalled" (SIGTERM/SIGUSR1) go through one MAX all-reduce over the
    world, so every rank holds the same decision for the same step. :attr:`found_inf` (0-dim fp32,
    1 = skip) is what a fused AdamW takes as ``optimizer.found_inf`` (as under GradScaler): it leaves
    weights, moments and its step count untouched without the host looking. The host reads
    :meth:`read` -- at once on a step that logs or saves, else one step late, when the device has long
    finished it (CUDA: a non-blocking copy to pinned memory and an event)."""

    def __init__(self, step: StepLoss, grad_norm: torch.Tensor, signalled: bool, number: int, decide: bool = True):
        device = step.loss.device
        loss = step.loss.float()
        aux = torch.zeros((), device=device) if step.aux is None else step.aux.float()
        norm = grad_norm.float().to(device)
        objective = loss + step.aux_coef * aux if step.aux_coef else loss
        bad = (~torch.isfinite(objective) | ~torch.isfinite(norm)).float() if decide else torch.zeros((), device=device)
        flags = torch.stack([bad, torch.full((), 1.0 if signalled else 0.0, device=device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [2]: every rank's decision is the world's
        self.number = number
        """The step (1-based) these values belong to."""
        self.found_inf = flags[0] if decide else None
        self.values = torch.stack([loss, aux, norm, flags[0], flags[1]])  # [5] fp32: GuardValues' fields in order
        self.aux_coef, self.has_aux = step.aux_coef, step.aux is not None
        self._host = self._event = None

    def to_host(self) -> "StepGuard":
        """Start the copy of :attr:`values` to the host without waiting for it (CUDA); a no-op on CPU."""
        if self.values.device.type == "cuda":
            self._host = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
            self._host.copy_(self.values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return self

    def read(self, extra: torch.Tensor | None = None) -> GuardValues:
        """The values on the host (and ``extra``'s, read in the same transfer: :attr:`GuardValues.logged`):
        waits for the device unless :meth:`to_host` ran a step earlier."""
        if extra is not None:
            both = torch.cat([self.values.double(), extra.to(self.values.device).double().flatten()]).tolist()
            values, logged = both[:5], tuple(both[5:])
        elif self._host is not None:
            self._event.synchronize()
            values, logged = self._host.tolist(), ()
        else:
            values, logged = self.values.tolist(), ()
        loss, aux, grad_norm, nonfinite, signalled = values
        return GuardValues(loss, aux, grad_norm, nonfinite > 0, signalled > 0, logged)


def optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> None:
    """``optimizer.step()``, skipped on the device where ``found_inf`` is 1 (fused AdamW: weights,
    moments and the step count stay as they were)."""
    if found_inf is None:
        optimizer.step()
        return
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Fused AdamW (CUDA and CPU) takes a device-side ``found_inf``; the foreach one refuses it."""
    return all(group.get("fused") for group in optimizer.param_groups)
