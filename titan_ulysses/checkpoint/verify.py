"""The one check every reader of a checkpoint makes before it reads anything (issue 33).

Resume, ``checkpoint.initial_load_path``, the evals (``eval_needle``, ``eval_long``) and both
exports (merged and ``--adapter-only``) call :func:`checkpoint_problem` / :func:`verify_checkpoint`
on a ``step-N`` folder: it exists and is complete (``.metadata``), its ``manifest.json`` is
readable, every file the manifest lists is there with its size, and the files' CRC-32s match.
DCP alone reads changed tensor bytes silently (an export of a checkpoint with 400 flipped
bytes wrote 100 wrong values), so nothing reads a checkpoint that fails this.

The checksums are the expensive part: a caller says which ``.distcp`` shards it checksums.
``ALL`` (one process: the exports, the evals before their process group); ``(rank, world)``,
every world-th shard, when the ranks of a process group split them and gather the answers
(``CheckpointManager.verify``); ``None``, none, for the check before the process group of a
launch, whose load then checksums the shards on the ranks together. The other files (the
metadata, the model and LoRA records, ``hf_assets/``) are small and always checksummed.
"""

from __future__ import annotations

from titan_ulysses.checkpoint import manifest
from titan_ulysses.checkpoint.steps import missing_checkpoint

ALL = (0, 1)
_SHARD = ".distcp"


class UntrustedCheckpointError(ValueError):
    """A checkpoint failed verification against its manifest: one line naming the file and why."""


def checkpoint_problem(path: str, setting: str, shards: tuple[int, int] | None = ALL) -> str | None:
    """Why the checkpoint ``path`` (given by ``setting``) cannot be read, or None.

    ``shards``: which ``.distcp`` files this caller checksums (see the module docstring).
    """
    reason = missing_checkpoint(path, setting)
    if reason:
        return reason
    try:
        files = manifest.read_manifest(path)
    except ValueError as e:
        return str(e)
    if files is None:  # every commit writes one: a step without it cannot be trusted (issue 20)
        return (f"{path} has no {manifest.MANIFEST}, so it cannot be verified (DCP would load changed bytes "
                f"silently); every checkpoint is committed with one")
    reason = manifest.check_sizes(path, files)
    if reason:
        return reason
    small = [name for name in sorted(files) if not name.endswith(_SHARD)]
    big = [name for name in sorted(files) if name.endswith(_SHARD)]
    mine = [] if shards is None else manifest.share(big, *shards)
    return manifest.check_sums(path, small + mine, files)


def verify_checkpoint(path: str, setting: str, shards: tuple[int, int] | None = ALL) -> None:
    """Raise when ``path`` fails :func:`checkpoint_problem`: FileNotFoundError when it is not a
    complete checkpoint, UntrustedCheckpointError when it does not match its manifest."""
    reason = missing_checkpoint(path, setting)
    if reason:
        raise FileNotFoundError(reason)
    reason = checkpoint_problem(path, setting, shards)
    if reason:
        raise UntrustedCheckpointError(untrusted(path, setting, reason))


def untrusted(path: str, setting: str, reason: str) -> str:
    """The one-line refusal of a checkpoint that failed verification."""
    return (f"{setting}: checkpoint {path} fails verification: {reason}; nothing was read from it: point "
            f"{setting} at another step-N (or restore this one from a good copy)")
