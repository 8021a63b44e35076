"""Save and resume with torch.distributed.checkpoint (DCP); complete or absent.

Layout on disk: ``{folder}/step-{N}/`` holds one checkpoint (DCP shards + ``.metadata`` +
``manifest.json``). A save is written to ``step-{N}.tmp``; once every rank's data and the
metadata are on disk, the ranks checksum the files (each a share), rank 0 writes the
manifest (``manifest.py``) and renames the folder to ``step-{N}``. A crash or a failing
save therefore never leaves a half checkpoint that resume would pick, and never touches the
last good one. Weights or optimizer state holding NaN/inf are never saved (``safety.py``).

Resume (``load()``) takes the newest checkpoint that passes verification (every file's size and checksum:
``verify.py``, each rank checksumming a share) and loads; one that fails either (a checksum, the manifest, a file
read) is renamed ``step-N.bad`` with a warning naming the file and why, and the previous one is tried; any other
load error is the code's: the run stops with one line and every file stays (``fit.py``). At start-up leftover
``step-N.tmp`` folders are removed and ``step-N`` folders without ``.metadata`` are set aside.

Rank 0 adds the files of ``extras(step_dir)`` (the model record of ``hf_export.py``) to
the ``.tmp`` folder before the rename, so they are part of the complete checkpoint.

What is saved (``state.py``): model and optimizer (sharded, FQN-keyed, so DCP reshards
them to any layout on load), LR scheduler, data loader (its position is global), step and
rank 0's RNG.

Async saves (``async`` / ``async_with_pinned_mem``) copy the state to host memory inside
``save()`` and write it from a background thread over a dedicated gloo group; the copy
is what gets written, so training may go on changing the parameters. At most one save is
in flight: the next ``save()``, ``wait()``, ``load()`` or ``close()`` finishes (commits) it.

Every collective of checkpointing runs on the manager's own gloo group, whose timeout
(``comm.init_timeout_seconds``) is longer than the training loop's: writing and checksumming
a large checkpoint takes minutes.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from titan_ulysses.checkpoint import manifest
from titan_ulysses.checkpoint.fit import (CODE_ERROR, DOES_NOT_FIT, code_error_refusal, load_failure, mismatch_refusal,
                                          model_mismatch, model_shapes, saved_settings)
from titan_ulysses.interop.peft_export import AdapterMismatchError, check_adapters, model_only_planner
from titan_ulysses.checkpoint.safety import (clean_up, commit_failed, explain_save_error, nonfinite_tensors, set_aside,
                                             state_bytes)
from titan_ulysses.checkpoint.state import training_state
from titan_ulysses.checkpoint.steps import complete_steps, missing_checkpoint  # noqa: F401 (public here)
from titan_ulysses.checkpoint.verify import UntrustedCheckpointError, checkpoint_problem, untrusted
from titan_ulysses.data.sources import DataError

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
LOAD_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException is a BaseException


class NonFiniteStateError(RuntimeError):
    """The weights or optimizer state hold NaN/inf: nothing was saved."""


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _publish(tmp: str, final: str) -> None:
    """The commit: one atomic rename, then the folder's entry flushed to disk."""
    os.rename(tmp, final)
    fd = os.open(os.path.dirname(final) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check(path: str, setting: str = "checkpoint.initial_load_path") -> None:
    reason = missing_checkpoint(path, setting)
    if reason:
        raise FileNotFoundError(reason)


class CheckpointManager:
    def __init__(self, *, folder: str, model, optimizer, lr_scheduler, dataloader, enable: bool,
                 interval: int, async_mode: str = "disabled", keep_latest_k: int = 0,
                 settings: dict | None = None, timeout_seconds: float | None = None, extras=None,
                 check_settings=None):
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
        self.extras = extras
        self.settings = settings  # saved with each checkpoint
        # check_settings(saved): raises (one line) before a load of saved settings that may not be resumed
        self.check_settings = check_settings
        self.loaded_settings: dict | None = None  # those of the checkpoint loaded, when it has them
        self.rank = dist.get_rank()
        self._pending = None  # (future, step) of an async save in flight
        self._started: dict[int, float] = {}  # step -> when its save began (for the commit line)
        self._last_saved = None
        self._pg = None
        self._stager = None
        if enable:
            # Checkpoint collectives run on their own CPU group: background saves sharing a group
            # with the training loop's collectives (NCCL, or even gloo) would interleave with them
            # and deadlock, and saves need a longer timeout than training steps.
            timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
            self._pg = dist.new_group(backend="gloo", timeout=timeout)
        if enable and async_mode == "async_with_pinned_mem":
            from titan_ulysses.checkpoint.staging import ReusableStager

            # One stager for the whole run: its host buffers (pinned when CUDA is there) are
            # allocated at the first save and reused, so later saves only pay the copy.
            # Staging is synchronous; the write runs in the background.
            self._stager = ReusableStager(pinned=torch.cuda.is_available())

    @property
    def group(self):
        """The process group of checkpoint collectives (None: the default group)."""
        return self._pg

    # -- paths ---------------------------------------------------------------------------

    def _dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def step_dir(self, step: int) -> str:  # the folder of this run's checkpoint of ``step``
        return self._dir(step)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step in this run's folder, None when there is none."""
        steps = complete_steps(self.folder)
        return steps[-1] if steps else None

    def _newest_good(self) -> str | None:
        step = self.latest_step()
        return None if step is None else self._dir(step)

    def _state(self, step: int = 0, model_only: bool = False, train_keys: set[str] | None = None) -> dict:
        return training_state(self.model, self.optimizer, self.lr_scheduler, self.dataloader, step=step,
                              train_keys=train_keys, settings=self.settings, model_only=model_only)

    # -- collectives on the checkpoint group ---------------------------------------------

    def _world(self) -> int:
        return dist.get_world_size(self._pg)

    def _barrier(self) -> None:
        dist.barrier(group=self._pg)

    def from_rank0(self, value):
        """Rank 0's ``value`` on every rank (on the checkpoint group). Collective."""
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._pg, 0) if self._pg else 0, group=self._pg)
        return box[0]

    _from_rank0 = from_rank0

    def _gather(self, value) -> list:
        out = [None] * self._world()
        dist.all_gather_object(out, value, group=self._pg)
        return out

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, force: bool = False) -> None:
        """Save at ``step`` if enabled and it is a save step (or ``force``). Collective."""
        if not self.enable or (not force and step % self.interval):
            return
        if self._last_saved == step or (self._pending is not None and self._pending[1] == step):
            return
        self._finish_pending()
        self._refuse_nonfinite(step)
        self._started[step] = time.perf_counter()
        final = self._dir(step)
        if os.path.isfile(os.path.join(final, ".metadata")):  # already complete (a rerun after a resume)
            self._last_saved = step
            return
        tmp = final + ".tmp"
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            if os.path.isdir(final):  # incomplete (no .metadata): never let it block this save
                _warn(f"{final} has no .metadata (an incomplete checkpoint); moved aside to {set_aside(final)}")
            for name in os.listdir(self.folder):  # leftovers of crashed or failed saves
                if name.startswith("step-") and name.endswith(".tmp"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        self._barrier()
        state = self._state(step)
        if self.async_mode == "disabled":
            try:
                dcp.save(state, checkpoint_id=tmp, process_group=self._pg)  # raises on every rank if any failed
            except LOAD_ERRORS as e:
                self._explain(e, tmp)
                raise
            self._commit(step)
            return
        kwargs = {"async_stager": self._stager} if self._stager is not None else {}
        result = dcp.async_save(state, checkpoint_id=tmp, process_group=self._pg, **kwargs)
        # a stager staging in the background returns an AsyncSaveResponse; ours stages in place
        future = getattr(result, "upload_completion", result)
        self._pending = (future, step)

    def _refuse_nonfinite(self, step: int) -> None:
        """Raise on every rank if any rank's weights or optimizer state hold NaN/inf (collective)."""
        found = [(r, bad) for r, bad in enumerate(self._gather(nonfinite_tensors(self.model, self.optimizer))) if bad]
        if not found:
            return
        rank, bad = found[0]
        good = self._newest_good()
        kept = f"the newest checkpoint, {good}, is kept" if good else "no checkpoint had been saved"
        raise NonFiniteStateError(
            f"step {step}: {sum(len(b) for _, b in found)} tensor(s) of the weights or optimizer state hold "
            f"NaN/inf (rank {rank}: {bad[0]}); nothing was saved and {kept}"
        )

    def _explain(self, error: BaseException, tmp: str) -> None:
        """Re-raise a failed save as an OSError naming the path, the space needed and the space free."""
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return
        newest = self._newest_good()
        files = manifest.read_manifest(newest) if newest else None
        needed = sum(e["size"] for e in files.values()) if files else state_bytes(self.model, self.optimizer) * self._world()
        raise explain_save_error(error, tmp, needed, newest, len(complete_steps(self.folder))) from error

    def _finish_pending(self) -> bool:
        """Wait for the save in flight and commit it; False when there was none."""
        if self._pending is None:
            return False
        future, step = self._pending
        self._pending = None
        try:
            future.result()  # raises if the background save failed: nothing is committed
        except LOAD_ERRORS as e:
            self._explain(e, self._dir(step) + ".tmp")
            raise
        # rank 0's save ends by writing .metadata, after gathering every rank's write results
        self._commit(step)
        return True

    def _commit(self, step: int) -> None:
        """Checksum the written files (each rank a share), write the manifest, rename. Collective."""
        final = self._dir(step)
        tmp = final + ".tmp"
        if self.rank == 0 and self.extras is not None:
            self.extras(tmp)  # written before the manifest, so they are checked like the shards
        names = self._from_rank0(manifest.data_files(tmp) if self.rank == 0 else None)
        mine = manifest.share(names, dist.get_rank(self._pg), self._world())
        entries = {}
        for part in self._gather({name: manifest.checksum(os.path.join(tmp, name)) for name in mine}):
            entries.update(part)
        error = None
        if self.rank == 0:
            try:
                manifest.write_manifest(tmp, step, entries)
                _publish(tmp, final)  # atomic: the checkpoint appears whole or not at all
                self._prune(keep=step)
                seconds = time.perf_counter() - self._started.pop(step, time.perf_counter())
                size = sum(e["size"] for e in entries.values())
                print(f"checkpoint: committed step {step} to {final} ({size / 2**20:.1f} MiB, {seconds:.1f} s)",
                      flush=True)
            except OSError as e:
                error = f"committing {tmp}: {e}"
        error = self._from_rank0(error)
        if error:
            raise commit_failed(error, self._newest_good())
        self._last_saved = step

    def _prune(self, keep: int) -> None:
        if self.keep_latest_k > 0:
            for old in complete_steps(self.folder)[: -self.keep_latest_k]:
                if old != keep:  # never the checkpoint just committed
                    shutil.rmtree(self._dir(old), ignore_errors=True)

    def wait(self) -> None:
        """Finish and commit an async save in flight (collective when one is)."""
        self._finish_pending()

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -- loading -------------------------------------------------------------------------

    def _clean_up(self) -> None:
        """Rank 0, at start-up: remove leftover ``.tmp`` saves, set incomplete step folders aside."""
        if self.rank == 0:
            clean_up(self.folder, _warn)
        self._barrier()

    def verify(self, path: str, setting: str = "the checkpoint") -> str | None:
        """Why ``path`` fails verification against its manifest (``verify.py``), or None. Collective:
        each rank checksums a share of the shards, every rank gets the same answer."""
        share = (dist.get_rank(self._pg), self._world())
        return next((r for r in self._gather(checkpoint_problem(path, setting, share)) if r), None)

    def load(self, step: int = -1) -> int:
        """Resume: load the newest good checkpoint of this run (or the given step); the step, or 0.

        Checkpoints that fail verification or a file read while loading are set aside (``step-N.bad``) with a
        warning, and the previous one is tried; any other load error stops the run (``LoadCodeError``). A good one of other settings (``check_settings``, keys, shapes: ``fit.py``) is
        refused before anything is loaded, and never set aside.
        """
        self.wait()
        if step != -1:
            path = self._dir(step)
            return self.load_from(path, "the resume step")
        self._clean_up()
        touched = None  # a checkpoint whose failed load may have changed the state in memory
        for step in reversed(complete_steps(self.folder)):
            path = self._dir(step)
            reason = self.verify(path, "the resume")
            if reason is None:
                self._refuse_mismatch(path)
                try:
                    loaded = self._load_full(path)
                except (DataError, AdapterMismatchError):  # sound, of other settings: refuse, never set aside
                    raise
                except LOAD_ERRORS as e:
                    loaded, reason = None, load_failure(e)
                reasons = [r for r in self._gather(reason) if r]  # every rank must have loaded
                if not reasons:
                    return loaded
                misfit = next((r for r in reasons if r.startswith(DOES_NOT_FIT)), None)  # not damage
                if misfit:
                    raise mismatch_refusal(path, misfit, self._from_rank0(self._saved(path)), self.settings)
                if any(r.startswith(CODE_ERROR) for r in reasons):  # nor is a code error: stop, set nothing aside
                    raise code_error_refusal(path, next(r for r in reasons if r.startswith(CODE_ERROR)))
                reason, touched = reasons[0], path
            if self.rank == 0:
                _warn(f"checkpoint {path} is damaged: {reason}; moved aside to {set_aside(path)}, "
                      f"falling back to the previous checkpoint")
            self._barrier()
        if touched is not None:
            raise RuntimeError(
                f"no checkpoint in {self.folder} could be loaded (the damaged ones were moved aside, see the "
                f"warnings above); {touched} failed while loading, so the state in memory is not a clean start: "
                f"restore a good copy as a step-N folder, or rerun with --checkpoint.allow_fresh_start true to start "
                f"over from the run's start weights"
            )
        return 0

    def _saved(self, path: str) -> dict | None:  # read by rank 0
        return saved_settings(path) if self.rank == 0 else None

    def _refuse_mismatch(self, path: str) -> None:
        """Raise on every rank, before any load, when the verified checkpoint ``path`` is of other
        settings: ``check_settings`` refuses its saved ones, or its model's keys or shapes differ."""
        saved = self._from_rank0(self._saved(path))
        if self.check_settings is not None:
            self.check_settings(saved)
        check_adapters(self.model, FileSystemReader(path).read_metadata().state_dict_metadata, path)  # LoRA's line
        reason = next((r for r in self._gather(model_mismatch(path, model_shapes(self.model))) if r), None)
        if reason:
            raise mismatch_refusal(path, reason, saved, self.settings)

    def _verified(self, path: str, setting: str) -> None:
        """Raise (on every rank) unless ``path`` is a complete checkpoint that passes verification."""
        _check(path, setting)
        reason = self.verify(path, setting)
        if reason:
            raise UntrustedCheckpointError(untrusted(path, setting, reason))

    def load_from(self, path: str, setting: str = "checkpoint.initial_load_path") -> int:
        """Load the full training state from a ``step-N`` folder (any layout); returns its step."""
        self._verified(path, setting)
        return self._load_full(path)

    def _load_full(self, path: str) -> int:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        check_adapters(self.model, metadata, path)  # LoRA: the adapters must be this run's
        saved = set(metadata)
        keys = {key.split(".", 1)[1] for key in saved if key.startswith("train_state.")}
        state = self._state(train_keys=keys)
        if "dataloader.dataset_state.data_settings" not in saved and hasattr(self.dataloader, "dataset"):
            from titan_ulysses.data.loader import WithoutSettings  # a checkpoint older than the settings record

            state["dataloader"] = WithoutSettings(self.dataloader)
        dcp.load(state, checkpoint_id=path, process_group=self._pg)
        self.loaded_settings = state["train_state"].settings
        step = state["train_state"].step
        self._last_saved = step
        return step

    def load_model_only(self, path: str, setting: str = "checkpoint.initial_load_path") -> None:
        """Load only the weights (start a new run from another run's model, e.g. context extension)."""
        self._verified(path, setting)
        planner = model_only_planner(self.model, path)  # LoRA: a base checkpoint has no adapters
        dcp.load(self._state(model_only=True), checkpoint_id=path, process_group=self._pg, planner=planner)
