"""Held-out loss at the training layout: the same batches every time, no gradients.

The loss is the mean over every loss-carrying token of ``validation.steps`` global batches:
each batch goes through the training step's own ``forward_backward`` (no gradients), and
the batches' means are weighted by their token counts, so it is the same at every layout.
After the ``no_grad`` forward every FSDP module is resharded: the root module keeps its
parameters unsharded after forward (``reshard_after_forward=False``), and a checkpoint
save right after evaluation would otherwise see unsharded parameters.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from titan_ulysses.data.sharding import shard_loader_batch
from titan_ulysses.step import forward_backward


def reshard(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class Validator:
    """Evaluates ``steps`` global batches of ``data.validation_loader()`` with ``model``.

    ``due(step)``: every ``freq`` steps and at ``last_step`` (None: every ``freq`` steps only).
    """

    def __init__(self, data, model, parallel_dims, device, pad_id: int,
                 microbatches_per_step: int, steps: int, freq: int = 1, last_step: int | None = None):
        self.data, self.model, self.pd, self.device = data, model, parallel_dims, device
        self.pad_id = pad_id
        self.microbatches_per_step, self.steps = microbatches_per_step, steps
        self.packed = getattr(data.validation, "packed", False)
        self.freq, self.last_step = freq, last_step

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def run(self) -> dict:
        sp_mesh, cp_mesh = self.pd.get_mesh("sp"), self.pd.get_mesh("cp")
        it = iter(self.data.validation_loader())
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # summed token losses
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        for _ in range(self.steps):  # a step's microbatches at a time, as training holds them
            microbatches = [shard_loader_batch(next(it), sp_mesh.get_local_rank(), sp_mesh.size(), self.device,
                                               self.packed, self.pad_id, cp_mesh.get_local_rank(), cp_mesh.size())
                            for _ in range(self.microbatches_per_step)]
            step = forward_backward(self.model, microbatches, self.pd.get_mesh("loss"))
            # a batch without loss tokens has a 0/0 mean: it adds nothing (a NaN of the model still shows)
            total += torch.where(step.tokens > 0, step.loss.double() * step.tokens, 0.0)
            tokens += step.tokens
        reshard(self.model)
        total, tokens = torch.stack([total, tokens]).tolist()  # the one read of the device
        return {"validation_loss": total / max(tokens, 1.0), "validation_tokens": int(tokens)}


def build_validator(config, data, model, parallel_dims, device, pad_id: int,
                    microbatches_per_step: int) -> Validator | None:
    """The run's validator (``validation.steps`` batches every ``validation.freq`` steps and at
    the last one), None when ``validation.enable`` is off."""
    v = config.validation
    if not v.enable:
        return None
    return Validator(data, model, parallel_dims, device, pad_id, microbatches_per_step, v.steps,
                     freq=v.freq, last_step=config.training.steps)
