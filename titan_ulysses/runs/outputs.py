"""What the commands write (an export's folder, a plan's TOML, a plot): never over other work, never over a run.

* ``output_problem``: a folder that is, holds, or lies inside a run's checkpoints or a checkpoint (a ``.run.lock``,
  a ``step-N``, a DCP ``.metadata``, a ``manifest.json``, a run's ``metrics.jsonl`` / ``summary.json``) is refused
  with or without ``--overwrite``: an export with ``--overwrite`` into a run's checkpoint folder deleted every
  checkpoint of the run, the one being exported included (issue 43). So are the current folder or one above it,
  and a folder that holds the source checkpoint. A non-empty folder is refused unless it holds nothing but a
  previous export (``is_previous_export``), and then only with ``--overwrite``. A new subfolder of a run's dump
  folder (``outputs/R/hf``) is fine: it replaces nothing of the run.
* ``staged_folder``: the folder is written beside the target (``NAME.tmp-PID``) and renamed into place when
  complete, the old one (with ``--overwrite``) renamed away first and removed after: a failed export leaves the
  target as it was. With ``mark`` it writes ``EXPORT_MARKER``, listing the files, into the new folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

EXPORT_MARKER = ".titan-export.json"
_STEP = re.compile(r"^step-\d+(\.bad)?$")
_CHECKPOINT_FILES = (".metadata", "manifest.json")  # a DCP checkpoint, one this trainer vouches for
_RUN_FILES = (".run.lock", "metrics.jsonl", "summary.json")  # a run's dump or checkpoint folder
_EXPORT_NAME = re.compile(r"^(config\.json|.*\.safetensors|.*\.safetensors\.index\.json|adapter_config\.json)$")


def _is_checkpoint(folder: str) -> bool:
    """``folder`` holds a DCP ``.metadata`` or a ``manifest.json``."""
    return any(os.path.isfile(os.path.join(folder, n)) for n in _CHECKPOINT_FILES)


def _inside_checkpoint(path: str, checkpoint_folders: bool = True) -> str | None:
    """The checkpoint (a folder with ``.metadata`` or ``manifest.json``) that ``path`` is or lies inside, or (with
    ``checkpoint_folders``) the checkpoint folder (one holding a ``step-N`` checkpoint) it lies inside; else None."""
    probe = os.path.realpath(path)
    first = True
    while True:
        names = []
        with contextlib.suppress(OSError):  # a folder above that this user cannot list holds nothing of ours
            names = os.listdir(probe) if os.path.isdir(probe) else []
        if any(n in names for n in _CHECKPOINT_FILES):
            return probe
        if checkpoint_folders and not first and any(_STEP.match(n) and _is_checkpoint(os.path.join(probe, n))
                                                    for n in names):
            return f"folder {probe}"
        first = False
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent


def _is_run_entry(folder: str, name: str) -> bool:
    """``folder/name`` is a run's or a checkpoint's: a lock, metrics, a summary, DCP metadata, a manifest, a step."""
    full = os.path.join(folder, name)
    return name in _CHECKPOINT_FILES or name in _RUN_FILES or bool(_STEP.match(name) and os.path.isdir(full))


def _run_data(path: str) -> list[str]:
    """What of a run or a checkpoint ``path`` holds: its own such entries, and its subfolders that hold some
    (``checkpoint/``: a dump folder's checkpoints)."""
    found = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if _is_run_entry(path, name):
            found.append(name)
        elif os.path.isdir(full) and not os.path.islink(full):
            with contextlib.suppress(OSError):
                if any(_is_run_entry(full, n) for n in os.listdir(full)):
                    found.append(name + "/")
    return found


def is_previous_export(path: str) -> bool:
    """``path`` holds nothing but a previous export: its ``EXPORT_MARKER``, the files it lists, and Hugging Face
    weights and config (``config.json``, ``*.safetensors``, their index; e.g. stale shards of a larger model);
    no subfolder."""
    try:
        with open(os.path.join(path, EXPORT_MARKER)) as f:
            listed = set(json.load(f).get("files", []))
    except (OSError, ValueError, AttributeError):
        return False
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.islink(full) or not os.path.isfile(full):
            return False
        if name != EXPORT_MARKER and name not in listed and not _EXPORT_NAME.match(name):
            return False
    return True


def _folder_problem(option: str, path: str, overwrite: bool, source: str) -> str | None:
    """``output_problem`` for a folder that a command replaces whole (an export)."""
    run = _run_data(path) if os.path.isdir(path) else []
    if run:
        shown = ", ".join(run[:4]) + (f", ... ({len(run)} entries)" if len(run) > 4 else "")
        return (f"{option} {path!r} holds a run or a checkpoint ({shown}); an export never replaces one, with or "
                f"without --overwrite: name a new folder")
    real = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if real == cwd or cwd.startswith(real.rstrip(os.sep) + os.sep):
        where = "the current folder" if real == cwd else f"a folder above the current one ({cwd})"
        return f"{option} {path!r} is {where}, which an export cannot replace; name a new folder, e.g. {path}/hf"
    if source:
        src = os.path.realpath(source)
        if src == real or src.startswith(real.rstrip(os.sep) + os.sep):
            return (f"{option} {path!r} holds the checkpoint being exported ({source}); name a folder outside "
                    f"the run, e.g. a new one beside it")
    if not os.path.isdir(path):
        return None
    names = sorted(os.listdir(path))
    if not names or (overwrite and is_previous_export(path)):
        return None
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
    if is_previous_export(path):
        return f"{option} {path!r} holds a previous export ({shown}); pass --overwrite to replace it, or name a new folder"
    return (f"{option} {path!r} is not empty ({shown}) and is not a previous export (no {EXPORT_MARKER}); "
            f"name a new or empty folder (--overwrite replaces only a previous export)")


def output_problem(option: str, path: str, overwrite: bool, folder: bool, checkpoint: str = "") -> str | None:
    """Why the command may not write ``path`` (given by ``option``; a folder when ``folder``), or None.
    ``checkpoint``: the source a folder is made from, never inside what is replaced."""
    inside = _inside_checkpoint(path, checkpoint_folders=folder)  # a file (a plot, a plan) beside checkpoints is fine
    if checkpoint and not inside and os.path.realpath(path).startswith(os.path.realpath(checkpoint) + os.sep):
        inside = checkpoint
    if inside:
        return (f"{option} {path!r} lies inside the checkpoint {inside}; writing there would change the checkpoint: "
                f"name a folder outside it")
    parent = os.path.dirname(os.path.abspath(path))
    if not folder and not os.path.isdir(parent):
        return f"{option} {path!r}: the folder {parent} does not exist; create it or name a file in an existing folder"
    if folder and os.path.isfile(path):
        return f"{option} {path!r} is a file, not a folder; name a folder (it is created if missing)"
    if not folder and os.path.isdir(path):
        return f"{option} {path!r} is a folder; name a file"
    if folder:
        return _folder_problem(option, path, overwrite, checkpoint)
    if not overwrite and os.path.exists(path):
        return f"{option} {path!r} exists; pass --overwrite to replace it, or name a new file"
    return None


@contextlib.contextmanager
def staged_folder(path: str, mark: bool = False):
    """Yield a fresh folder beside ``path``; on success it replaces ``path`` (renames), on failure it is removed.
    ``mark``: write ``EXPORT_MARKER`` (the files written) so that a later ``--overwrite`` knows it for an export."""
    path = os.path.abspath(path)  # "." would stage "..tmp-N" (refused before this by output_problem)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if mark:
            with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
                json.dump({"files": sorted(os.listdir(tmp))}, f, indent=1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(path):
        os.rename(path, old)  # the old folder is out of the way only once the new one is complete
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
