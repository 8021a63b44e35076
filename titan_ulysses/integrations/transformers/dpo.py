"""TRL's DPOTrainer at sp=N: every row's log-probability is summed over the whole sequence, across the sp ranks.

DPO's loss is a function of each sequence's summed log-probability; one rank holds only S/sp
of its tokens. A per-rank partial sum fed to ``logsigmoid`` is the classic bug (the loss and
gradients are then those of another objective). TRL 1.16 scores sequences through its fused
LM head: ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` returning per-token
``log_probs`` [B, S-1] (and ``entropy``, ``mean_logits``, ``is_top1`` for its metrics), then
sums them. Here the trainer's model and reference model are called through :class:`_SPScorer`,
which cuts the full rows with ``shard_batch``, scores this rank's tokens from the model's own
logits, and gathers the per-token values of the whole sequence (a differentiable all-gather:
its backward sums every rank's gradient), so TRL's own sums, masks and losses see one
process's tensors.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed._functional_collectives as funcol

from titan_ulysses.ops.loss import IGNORE_INDEX

from .batch import shard_batch


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P] on each rank -> [B, S_pad] on every rank, differentiable (backward sums the ranks' gradients)."""
    # functional collectives: backward is a reduce-scatter over ``group``. (torch.distributed.nn's all_gather emulates
    # it on gloo with scatters from group index i taken as a global rank: wrong for any sp group but the first, dp > 1)
    return funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=1, group=group)


class _SPScorer:
    """Stands in for a model inside DPOTrainer's loss: full rows in, full per-token scores out."""

    def __init__(self, model, mesh):
        self._model, self._mesh = model, mesh

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, labels=None, attention_mask=None, fused_lm_head=False, use_cache=None, **extra):
        if not fused_lm_head or labels is None or any(v is not None for v in extra.values()):
            raise ValueError(f"ulysses_trainer: DPO called the model with {sorted(extra) or 'no fused_lm_head'}; "
                             f"only TRL's fused_lm_head scoring of full rows is split over sp")
        seq = input_ids.shape[1]
        local = shard_batch({"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}, self._mesh)
        logits = self._model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                             use_cache=False).logits.float()  # [B, S/P, V]
        target = local["shift_labels"]  # [B, S/P]
        keep = target != IGNORE_INDEX
        logp = logits.log_softmax(-1)
        token_logp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * keep  # zero on ignored
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1) * keep
            mean_logits = logits.mean(-1)
            is_top1 = (logits.argmax(-1) == target) & keep
        group = self._mesh["sp"].get_group()
        full = {name: _gather_sequence(t, group)[:, :seq - 1]  # [B, S-1]: position t predicts token t+1
                for name, t in (("log_probs", token_logp), ("entropy", entropy), ("mean_logits", mean_logits),
                                ("is_top1", is_top1.to(torch.uint8)))}
        full["is_top1"] = full["is_top1"].bool()
        return SimpleNamespace(**full, log_sum_sq_probs=None, aux_loss=None, logits=None)


def shard_reference(trainer, ref):
    """DPO's reference model under FSDP2 as TRL shards it (``prepare_fsdp``: one ``fully_shard`` over every rank).

    TRL shards it in ``DPOTrainer.__init__`` when accelerate's state holds an FSDP plugin (GPU); on
    CPU accelerate dropped the plugin there and ``ulysses_trainer`` gives it back later, so the
    reference model is sharded here, before ``apply_ulysses``, in the order it has on GPU."""
    from torch.distributed.fsdp import FSDPModule

    if not getattr(trainer, "is_fsdp_enabled", False) or isinstance(ref, FSDPModule):
        return ref
    from trl.models import prepare_fsdp

    return prepare_fsdp(ref, trainer.accelerator)


@contextmanager
def unsharded(model, reshard_after_forward=True):
    """Full parameters in ``model``'s FSDP2 units while ``apply_ulysses`` probes it (DPO's reference model, sharded by
    TRL): the probe calls submodules one by one, outside the root's hooks, where FSDP2 leaves sharded DTensors, and
    differentiates through a forward after which FSDP2 would free the full parameters. ``reshard_after_forward``:
    the inner units' setting to restore (TRL's, from accelerate's plugin)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:  # the root keeps False, as FSDP2's lazy init (in the probe's forward) sets it
                unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


class UlyssesDPOMixin:
    """DPOTrainer's loss with its model and reference model scored through :class:`_SPScorer`.

    Mixed in front of UlyssesTrainerMixin: DPO keeps its own ``compute_loss`` (a mean over
    sequence pairs per micro-batch, divided by the accumulation steps as the Trainer does)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        from .trainer import UlyssesTrainerMixin

        return super(UlyssesTrainerMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _compute_loss(self, model, inputs, return_outputs):
        if return_outputs:
            raise ValueError("ulysses_trainer: DPO's return_outputs (compute_metrics) is not split over sp")
        if getattr(self, "ld_alpha", None) is not None or getattr(self, "aux_loss_enabled", False):
            raise ValueError("ulysses_trainer: DPOConfig.ld_alpha and MoE aux losses are not split over sp")
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            self.ref_model = _SPScorer(ref, self.ulysses_mesh)
        try:
            return super()._compute_loss(_SPScorer(model, self.ulysses_mesh), inputs, return_outputs)
        finally:
            if ref is not None:
                self.ref_model = ref

    def compute_ref_log_probs(self, model, inputs):
        return super().compute_ref_log_probs(_SPScorer(model, self.ulysses_mesh), inputs)

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # DPO's loss is a mean over sequence pairs, not over tokens
