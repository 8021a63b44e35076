"""Save and resume with torch.distributed.checkpoint (DCP); complete or absent.

Layout on disk: ``{folder}/step-{N}/`` holds one checkpoint (DCP shards + ``.metadata``).
A save is written to ``step-{N}.tmp`` and renamed to ``step-{N}`` by rank 0 only once
every rank's data and the metadata are on disk, so a crash or a failing save never leaves
a half checkpoint that resume would pick, and never touches the last good one.

What is saved: model and optimizer (sharded, FQN-keyed, so DCP reshards them to any
layout on load), LR scheduler, data loader (its position is global), step and rank 0's RNG.

Async saves (``async`` / ``async_with_pinned_mem``) copy the state to host memory inside
``save()`` and write it from a background thread over a dedicated gloo group; the copy
is what gets written, so training may go on changing the parameters. At most one save is
in flight: the next ``save()``, ``wait()``, ``load()`` or ``close()`` finishes (commits) it.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
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
    """Step and RNG. Rank 0 alone saves its generator states; on load every rank gets them.

    ``keys`` is the set of ``train_state`` entries a checkpoint holds (a checkpoint written
    without CUDA has no ``cuda_rng``); None when saving.
    """

    def __init__(self, step: int = 0, keys: set[str] | None = None):
        self.step, self.keys = step, keys

    def state_dict(self):
        state = {"step": self.step}
        saving = self.keys is None
        if saving and dist.get_rank() != 0:
            return state  # replicated entries would otherwise be written by whichever rank DCP picks
        if saving or "rng" in self.keys:
            state["rng"] = torch.get_rng_state()
        if torch.cuda.is_available() and (saving or "cuda_rng" in self.keys):
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        if "rng" in state_dict:
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


def _check(path: str) -> None:
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} is not a complete checkpoint (no .metadata); point checkpoint.initial_load_path "
            f"at a step-N folder"
        )


class CheckpointManager:
    def __init__(self, *, folder: str, model, optimizer, lr_scheduler, dataloader, enable: bool,
                 interval: int, async_mode: str = "disabled", keep_latest_k: int = 0):
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode {async_mode!r} is not one of {list(ASYNC_MODES)}")
        if interval < 1:
            raise ValueError(f"checkpoint.interval {interval} must be >= 1")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k {keep_latest_k} must be >= 0 (0 keeps all)")
        self.folder, self.enable, self.interval = folder, enable, interval
        self.async_mode, self.keep_latest_k = async_mode, keep_latest_k
        self.model, self.optimizer = model, optimizer
        self.lr_scheduler, self.dataloader = lr_scheduler, dataloader
        self.rank = dist.get_rank()
        self._pending = None  # (future, step) of an async save in flight
        self._last_saved = None
        self._async_pg = None
        self._stager = None
        if enable and async_mode != "disabled":
            # Background saves coordinate over their own CPU group: sharing a group with the
            # training loop's collectives (NCCL, or even gloo) would interleave them and deadlock.
            self._async_pg = dist.new_group(backend="gloo")
        if enable and async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # One stager for the whole run: its host buffers (pinned when CUDA is there) are
            # allocated at the first save and reused, so later saves only pay the copy.
            # Staging is synchronous; the write runs in the background.
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                use_async_staging=False, use_non_blocking_copy=False,
            ))

    # -- paths ---------------------------------------------------------------------------

    def _dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step in this run's folder, None when there is none."""
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def _state(self, step: int = 0, model_only: bool = False, train_keys: set[str] | None = None) -> dict:
        state = {"model": _Model(self.model)}
        if not model_only:
            state.update(
                optimizer=_Optimizer(self.model, self.optimizer), lr_scheduler=self.lr_scheduler,
                dataloader=self.dataloader, train_state=_TrainState(step, train_keys),
            )
        return state

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, force: bool = False) -> None:
        """Save at ``step`` if enabled and it is a save step (or ``force``). Collective."""
        if not self.enable or (not force and step % self.interval):
            return
        if self._last_saved == step or (self._pending is not None and self._pending[1] == step):
            return
        self._finish_pending()
        final = self._dir(step)
        if os.path.isdir(final):  # already complete (e.g. rerun after a resume): keep it
            self._last_saved = step
            return
        tmp = final + ".tmp"
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            for name in os.listdir(self.folder):  # leftovers of crashed or failed saves
                if name.startswith("step-") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        dist.barrier()
        state = self._state(step)
        if self.async_mode == "disabled":
            dcp.save(state, checkpoint_id=tmp)  # raises on every rank if any rank failed
            self._commit(step)
            return
        kwargs = {"async_stager": self._stager} if self._stager is not None else {}
        result = dcp.async_save(state, checkpoint_id=tmp, process_group=self._async_pg, **kwargs)
        # a stager staging in the background returns an AsyncSaveResponse; ours stages in place
        future = getattr(result, "upload_completion", result)
        self._pending = (future, step)

    def _finish_pending(self) -> bool:
        """Wait for the save in flight and commit it; False when there was none."""
        if self._pending is None:
            return False
        future, step = self._pending
        self._pending = None
        future.result()  # raises if the background save failed: nothing is committed
        # rank 0's save ends by writing .metadata, after gathering every rank's write results
        self._commit(step, barrier=False)
        return True

    def _commit(self, step: int, barrier: bool = True) -> None:
        if self.rank == 0:
            final = self._dir(step)
            os.rename(final + ".tmp", final)  # atomic: the checkpoint appears whole or not at all
            if self.keep_latest_k > 0:
                for old in complete_steps(self.folder)[: -self.keep_latest_k]:
                    shutil.rmtree(self._dir(old), ignore_errors=True)
        self._last_saved = step
        if barrier:
            dist.barrier()

    def wait(self) -> None:
        """Finish and commit an async save in flight (collective when one is)."""
        if self._finish_pending():
            dist.barrier()  # every rank now sees step-N

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -- loading -------------------------------------------------------------------------

    def load(self, step: int = -1) -> int:
        """Load the latest (or the given) complete checkpoint of this run; the step loaded, or 0."""
        self.wait()
        if step == -1:
            step = self.latest_step()
            if step is None:
                return 0
        return self.load_from(self._dir(step))

    def load_from(self, path: str) -> int:
        """Load the full training state from a ``step-N`` folder (any layout); returns its step."""
        _check(path)
        saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
        keys = {key.split(".", 1)[1] for key in saved if key.startswith("train_state.")}
        state = self._state(train_keys=keys)
        if "dataloader.dataset_state.data_settings" not in saved and hasattr(self.dataloader, "dataset"):
            from titan_ulysses.data.loader import WithoutSettings  # a checkpoint older than the settings record

            state["dataloader"] = WithoutSettings(self.dataloader)
        dcp.load(state, checkpoint_id=path)
        step = state["train_state"].step
        self._last_saved = step
        return step

    def load_model_only(self, path: str) -> None:
        """Load only the weights (start a new run from another run's model, e.g. context extension)."""
        _check(path)
        dcp.load(self._state(model_only=True), checkpoint_id=path)
