"""A run's folders and checkpointing, built for the trainer: the locks on its output folders,
the CheckpointManager, and the weights it starts from.

Locks come first (before data or model): two runs in one folder must not both get that far.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from titan_ulysses.interop.hf_export import write_model_record
from titan_ulysses.interop.hub import hub_id_of
from titan_ulysses.runs.lock import FolderInUseError, RunLock
from titan_ulysses.interop.peft_export import write_lora_record
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.checkpoint.weight_source import WeightSource, load_start_weights
from titan_ulysses.config.resume import overrides, resume_changes, resume_settings
from titan_ulysses.distributed.lora import init_lora
from titan_ulysses.models.build import init_weights


def _lock(folder: str, setting: str, rank: int) -> RunLock | None:
    """Rank 0 takes ``folder``'s lock for the life of the run; a refusal reaches every rank."""
    lock, error = None, None
    if rank == 0:
        lock = RunLock(folder, setting)
        try:
            note = lock.acquire()
            if note:
                print(f"warning: {note}", file=sys.stderr, flush=True)
        except FolderInUseError as e:
            lock, error = None, str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise FolderInUseError(box[0])
    return lock


def lock_run_folders(config, rank: int) -> list[RunLock]:
    """The locks this run holds (rank 0's; none elsewhere): ``job.dump_folder``'s, and the folder
    where its checkpoints are written (``checkpoint.folder``), inside the dump folder or not: a
    second run whose ``checkpoint.folder`` names the first run's checkpoint folder meets the
    first run's lock there, not only the first run's dump folder's (which it never touches). Collective."""
    c, dump = config.checkpoint, config.job.dump_folder
    locks = [_lock(dump, "job.dump_folder", rank)]
    folder = os.path.join(dump, c.folder)
    if c.enable and os.path.realpath(folder) != os.path.realpath(dump):  # the same folder: one lock
        locks.append(_lock(folder, "checkpoint.folder", rank))
    return [lock for lock in locks if lock is not None]


def build_checkpointer(config, model, optimizer, lr_scheduler, dataloader, args, lora) -> CheckpointManager:
    """The run's CheckpointManager (``[checkpoint]``); each save also holds the model record
    (``model_args.json``) and, with LoRA (``lora``: its options or None), the adapters' record."""
    c, m = config.checkpoint, config.model
    return CheckpointManager(
        folder=os.path.join(config.job.dump_folder, c.folder), model=model, optimizer=optimizer,
        lr_scheduler=lr_scheduler, dataloader=dataloader, enable=c.enable, interval=c.interval,
        async_mode=c.async_mode, keep_latest_k=c.keep_latest_k, settings=resume_settings(config),
        timeout_seconds=config.comm.init_timeout_seconds,
        # a resume's model settings are compared before the load (config/resume.py)
        check_settings=lambda saved: resume_changes(saved, resume_settings(config), overrides(config)),
        extras=lambda d: (write_model_record(d, args, m.hf_assets_path, config.training.seq_len),
                          write_lora_record(d, lora, hub_id_of(m.hf_assets_path) or m.hf_assets_path or m.flavor)),
    )


def load_weights(config, checkpointer: CheckpointManager, model, args, device: torch.device,
                 lora: bool) -> WeightSource:
    """One decision, then the load: this run's newest good checkpoint, ``initial_load_path``,
    the Hugging Face folder, or random init from ``training.seed``. Collective."""
    seed = config.training.seed
    return load_start_weights(
        config, checkpointer, model,
        lambda: init_weights(model, args, device, seed, lora=lora),
        # adapters start as peft's (B = 0); a checkpoint replaces them
        init_adapters=(lambda: init_lora(model, seed)) if lora else None,
    )
