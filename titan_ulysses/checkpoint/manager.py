"""Save and resume with torch.distributed.checkpoint (DCP); complete or absent.

Layout on disk: ``{folder}/step-{N}/`` holds one checkpoint (DCP shards + ``.metadata``).
A save is written to ``step-{N}.tmp`` and renamed to ``step-{N}`` by rank 0 only once
every rank's data and the metadata are on disk, so a crash or a failing save never leaves
a half checkpoint that resume would pick, and never touches the last good one.

What is saved: model and optimizer (sharded, FQN-keyed, so DCP reshards them to any
layout on load), LR scheduler, data loader (its position is global), step and RNG.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _Model(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict)


class _Optimizer(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict):
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class _TrainState(Stateful):
    """Step and RNG (rank 0's generator state is restored on every rank)."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self):
        state = {"step": self.step, "rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])
        if "cuda_rng" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda_rng"])


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending (``.tmp`` leftovers never count)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


class CheckpointManager:
    def __init__(self, *, folder: str, model, optimizer, lr_scheduler, dataloader, enable: bool,
                 interval: int, async_mode: str = "disabled", keep_latest_k: int = 0):
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode {async_mode!r} is not one of {list(ASYNC_MODES)}")
        self.folder, self.enable, self.interval = folder, enable, interval
        self.async_mode, self.keep_latest_k = async_mode, keep_latest_k
        self.model, self.optimizer = model, optimizer
        self.lr_scheduler, self.dataloader = lr_scheduler, dataloader
        self.rank = dist.get_rank()
        self._pending = None  # (future, tmp_dir, final_dir) of an async save in flight
        self._last_saved = None
        self._async_pg = None
        if enable and async_mode != "disabled":
            # Background saves coordinate over their own CPU group: sharing a group with the
            # training loop's collectives (even a gloo one) would interleave them and deadlock.
            self._async_pg = dist.new_group(backend="gloo")

    def _state(self, step: int = 0, model_only: bool = False) -> dict:
        state = {"model": _Model(self.model)}
        if not model_only:
            state.update(
                optimizer=_Optimizer(self.model, self.optimizer), lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader, train_state=_TrainState(step),
            )
        return state

    def latest_step(self) -> int | None:
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def save(self, step: int, force: bool = False) -> None:
        """Save at ``step`` if enabled and it is a save step (or ``force``)."""
        if not self.enable or (not force and step % self.interval) or self._last_saved == step:
            return
        self._finish_pending()
        final = os.path.join(self.folder, f"step-{step}")
        if os.path.isdir(final):  # already complete (e.g. rerun after a resume): keep it
            self._last_saved = step
            return
        tmp = final + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(self.folder, exist_ok=True)
        dist.barrier()
        state = self._state(step)
        if self.async_mode == "disabled":
            dcp.save(state, checkpoint_id=tmp)
            self._commit(tmp, final)
        else:
            kwargs = {}
            if self.async_mode == "async_with_pinned_mem" and torch.cuda.is_available():
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                kwargs["async_stager"] = DefaultStager(StagingOptions(use_pinned_memory=True))
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_pg, **kwargs)
            self._pending = (future, tmp, final)
        self._last_saved = step

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, tmp, final = self._pending
        self._pending = None
        result = future.result()  # raises if the background save failed: nothing is committed
        upload = getattr(result, "upload_completion", None)
        if upload is not None:
            upload.result()
        # rank 0 writes .metadata last, after every rank's data: its completion means all is on disk
        self._commit(tmp, final, barrier=False)

    def _commit(self, tmp: str, final: str, barrier: bool = True) -> None:
        if self.rank == 0:
            os.rename(tmp, final)  # atomic: the checkpoint appears whole or not at all
            if self.keep_latest_k > 0:
                for old in complete_steps(self.folder)[: -self.keep_latest_k]:
                    shutil.rmtree(os.path.join(self.folder, f"step-{old}"), ignore_errors=True)
        if barrier:
            dist.barrier()

    def wait(self) -> None:
        """Finish (commit) an async save in flight."""
        self._finish_pending()

    def close(self) -> None:
        self._finish_pending()

    def load(self, step: int = -1) -> int:
        """Load the latest (or the given) complete checkpoint of this run; the step loaded, or 0."""
        if step == -1:
            step = self.latest_step()
            if step is None:
                return 0
        return self.load_from(os.path.join(self.folder, f"step-{step}"))

    def load_from(self, path: str) -> int:
        """Load the full training state from a ``step-N`` folder (any layout); returns its step."""
        self._check(path)
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        self._last_saved = state["train_state"].step
        return state["train_state"].step

    def load_model_only(self, path: str) -> None:
        """Load only the weights (start a new run from another run's model, e.g. context extension)."""
        self._check(path)
        dcp.load(self._state(model_only=True), checkpoint_id=path)

    @staticmethod
    def _check(path: str) -> None:
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise FileNotFoundError(
                f"{path!r} is not a complete checkpoint (no .metadata); point checkpoint.initial_load_path "
                f"at a step-N folder"
            )
