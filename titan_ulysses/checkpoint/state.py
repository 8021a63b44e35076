"""What a checkpoint holds: the Stateful wrappers DCP saves and loads.

``training_state`` is the dict handed to ``dcp.save`` / ``dcp.load``: the model and the
optimizer through ``torch.distributed.checkpoint.state_dict`` (sharded, FQN-keyed, so DCP
reshards them to any layout on load), the LR scheduler and the data loader as they are
(each has ``state_dict`` / ``load_state_dict``), and ``TrainState`` (step, rank 0's RNG,
the run's resumable settings).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class ModelState(Stateful):
    """The model's weights, FQN-keyed (sharded parameters stay DTensors)."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimizer's state, keyed by parameter FQN rather than by index."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class TrainState(Stateful):
    """Step, RNG and the run's settings. Rank 0 alone saves its generator states; on load every
    rank gets them. ``settings`` (JSON of the config values a resume may change, see the
    trainer) lets the resumed run say what its config changed.

    ``keys`` is the set of ``train_state`` entries a checkpoint holds (a checkpoint written
    without CUDA has no ``cuda_rng``); None when saving.
    """

    def __init__(self, step: int = 0, keys: set[str] | None = None, settings: dict | None = None):
        self.step, self.keys, self.settings = step, keys, settings

    def state_dict(self):
        state = {"step": self.step}
        saving = self.keys is None
        if saving and dist.get_rank() != 0:
            return state  # replicated entries would otherwise be written by whichever rank DCP picks
        if (saving and self.settings is not None) or (not saving and "settings" in self.keys):
            state["settings"] = json.dumps(self.settings) if saving else ""
        if saving or "rng" in self.keys:
            state["rng"] = torch.get_rng_state()
        if torch.cuda.is_available() and (saving or "cuda_rng" in self.keys):
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        self.settings = json.loads(state_dict["settings"]) if state_dict.get("settings") else None
        if "rng" in state_dict:
            torch.set_rng_state(state_dict["rng"])
        if "cuda_rng" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda_rng"])


def training_state(model, optimizer=None, lr_scheduler=None, dataloader=None, *, step: int = 0,
                   train_keys: set[str] | None = None, settings: dict | None = None,
                   model_only: bool = False) -> dict:
    """The top-level state dict of a checkpoint (``model_only``: the weights alone)."""
    state = {"model": ModelState(model)}
    if not model_only:
        state.update(
            optimizer=OptimizerState(model, optimizer), lr_scheduler=lr_scheduler,
            dataloader=dataloader, train_state=TrainState(step, train_keys, settings),
        )
    return state
