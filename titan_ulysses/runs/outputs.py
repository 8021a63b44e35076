"""What the commands write (an export's folder, a plan's TOML, a plot): never over other work by surprise.

* ``output_problem``: a non-empty folder (or an existing file) is refused unless ``--overwrite``
  (an export over another model's Hugging Face folder replaced its config and weights silently,
  and over a sharded one left the old shards and index beside the new file); a folder inside
  a checkpoint is always refused (it would change the checkpoint its manifest vouches for);
  a file into a folder that does not exist is refused in one line, not a traceback.
* ``staged_folder``: the folder is written beside the target (``NAME.tmp-PID``) and renamed into
  place when complete, the old one (with ``--overwrite``) renamed away first and removed after:
  a failed export leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil


def _inside_checkpoint(path: str) -> str | None:
    """The ``step-N`` checkpoint folder (one with ``.metadata``) that ``path`` is or lies inside, or None."""
    probe = os.path.realpath(path)
    while True:
        if os.path.isfile(os.path.join(probe, ".metadata")):
            return probe
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent


def output_problem(option: str, path: str, overwrite: bool, folder: bool, checkpoint: str = "") -> str | None:
    """Why the command may not write ``path`` (given by ``option``; a folder when ``folder``), or None."""
    inside = _inside_checkpoint(path)
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
    if overwrite:
        return None
    if folder and os.path.isdir(path) and os.listdir(path):
        names = sorted(os.listdir(path))
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")
        return (f"{option} {path!r} is not empty ({shown}); pass --overwrite to replace it whole, or name a new "
                f"folder")
    if not folder and os.path.exists(path):
        return f"{option} {path!r} exists; pass --overwrite to replace it, or name a new file"
    return None


@contextlib.contextmanager
def staged_folder(path: str):
    """Yield a fresh folder beside ``path``; on success it replaces ``path`` (renames), on failure it is removed."""
    path = os.path.normpath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
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
