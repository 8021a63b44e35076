"""Held-out loss at the training layout: the same batches every time, no gradients.

The loss is the mean over every loss-carrying token of ``validation.steps`` global batches
(summed over microbatches and the ``loss`` mesh before dividing), so it is the same at
every layout. After the ``no_grad`` forward every FSDP module is resharded: the root
module keeps its parameters unsharded after forward (``reshard_after_forward=False``), and
a checkpoint save right after evaluation would otherwise see unsharded parameters.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from titan_ulysses.data.sharding import shard_loader_batch
from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX


def reshard(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Validator:
    """Evaluates ``steps`` global batches of ``data.validation_loader()`` with ``model``.

    ``due(step)``: every ``freq`` steps and at ``last_step`` (None: every ``freq`` steps only).
    """

    def __init__(self, data, model, parallel_dims, device, attn_backend: str, pad_id: int,
                 microbatches_per_step: int, steps: int, freq: int = 1, last_step: int | None = None):
        self.data, self.model, self.pd, self.device = data, model, parallel_dims, device
        self.attn_backend, self.pad_id = attn_backend, pad_id
        self.microbatches = microbatches_per_step * steps
        self.packed = getattr(data.validation, "packed", False)
        self.freq, self.last_step = freq, last_step

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def run(self) -> dict:
        sp_mesh, cp_mesh, loss_mesh = self.pd.get_mesh("sp"), self.pd.get_mesh("cp"), self.pd.get_mesh("loss")
        it = iter(self.data.validation_loader())
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(self.microbatches):
            mb = shard_loader_batch(next(it), sp_mesh.get_local_rank(), sp_mesh.size(), self.device,
                                    self.packed, self.pad_id, cp_mesh.get_local_rank(), cp_mesh.size())
            mask = build_attention_mask(self.attn_backend, mb.document_ids)
            total += self.model(mb.tokens, positions=mb.positions, attention_mask=mask, labels=mb.labels).double()
            tokens += (mb.labels != IGNORE_INDEX).sum()
        reshard(self.model)
        total, tokens = dist_sum(total, loss_mesh), dist_sum(tokens, loss_mesh)
        return {"validation_loss": (total / tokens.clamp(min=1)).item(), "validation_tokens": int(tokens.item())}


def build_validator(config, data, model, parallel_dims, device, attn_backend: str, pad_id: int,
                    microbatches_per_step: int) -> Validator | None:
    """The run's validator (``validation.steps`` batches every ``validation.freq`` steps and at
    the last one), None when ``validation.enable`` is off."""
    v = config.validation
    if not v.enable:
        return None
    return Validator(data, model, parallel_dims, device, attn_backend, pad_id, microbatches_per_step, v.steps,
                     freq=v.freq, last_step=config.training.steps)
