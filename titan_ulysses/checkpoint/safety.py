"""What keeps bad state out of the checkpoint folder, and explains a save that failed.

* ``nonfinite_tensors``: weights or optimizer state holding NaN/inf are never saved (a NaN
  learning rate passes the loss and gradient checks of the step and only shows in the
  weights after the update).
* ``clean_up``: a crashed save's leftovers never block a later one (at start-up);
* ``set_aside``: a damaged or incomplete ``step-N`` folder is renamed to ``step-N.bad``
  (kept for inspection, never picked again, never in the way of a later save).
* ``explain_save_error``: a save that failed says where, how much it needs and how much is
  free. A full disk does not always raise ENOSPC: PyTorch's zip writer reports a short write
  as ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos ...``; any
  failure where the space needed exceeds the space there was is named as a full disk.
"""

from __future__ import annotations

import errno
import os
import shutil

import torch

from titan_ulysses.checkpoint.errors import SaveFailedError
from titan_ulysses.checkpoint.manifest import METADATA
from titan_ulysses.data.build_lock import folder_bytes  # the bytes a failed save left, as a failed store build counts them


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_tensors(model, optimizer) -> list[str]:
    """Names of this rank's parameter shards and optimizer-state tensors that hold NaN or inf."""
    bad = []
    for name, p in model.named_parameters():
        if not torch.isfinite(_local(p.detach())).all():
            bad.append(name)
    names = {p: n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                if not torch.isfinite(_local(value)).all():
                    bad.append(f"optimizer {key} of {names.get(p, '?')}")
    return bad


def set_aside(path: str) -> str:
    """Rename ``path`` to ``path.bad`` (``.bad-2``, ... when taken); returns the new name."""
    target, n = f"{path}.bad", 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.bad-{n}"
    os.rename(path, target)
    return target


def clean_up(folder: str, warn) -> None:
    """At start-up: remove leftover ``step-N.tmp`` saves, set ``step-N`` folders without ``.metadata`` aside."""
    from titan_ulysses.checkpoint.steps import STEP_DIR

    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if name.startswith("step-") and name.endswith(".tmp"):
            warn(f"removing {path}, an unfinished save of an earlier run")
            shutil.rmtree(path, ignore_errors=True)
        elif STEP_DIR.match(name) and not os.path.isfile(os.path.join(path, METADATA)):
            warn(f"{path} has no .metadata (an incomplete checkpoint); moved aside to {set_aside(path)}")


def exceptions(exc: BaseException):
    """``exc``, its causes, and the per-rank failures a DCP CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # rank -> (exception, traceback)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def is_out_of_space(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in exceptions(exc))


def state_bytes(model, optimizer) -> int:
    """Bytes of this rank's shards of the weights and optimizer state (about what it writes)."""
    total = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(_local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _first_line(exc: BaseException) -> str:
    e = next((e for e in exceptions(exc) if not getattr(e, "failures", None)), exc)  # the rank's own error
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def explain_save_error(exc: BaseException, path: str, needed: int, newest_good: str | None,
                       checkpoints: int = 0) -> SaveFailedError:
    """A one-line SaveFailedError saying that saving to ``path`` failed (ran out of space, when it did), how much
    it needs and has, and advice that fits: ``checkpoints`` (complete ones in the folder) decides whether a lower
    ``checkpoint.keep_latest_k`` can make room (it cannot with one checkpoint, which is always kept)."""
    folder = os.path.dirname(path)
    free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
    held = folder_bytes(path) if os.path.isdir(path) else 0  # written by the failed save, freed at the next start
    kept = f"the newest good checkpoint, {newest_good}, is kept" if newest_good else "no checkpoint was saved before"
    space = (f"a checkpoint of this run needs about {needed / 2**30:.2f} GiB and {free / 2**30:.2f} GiB are free on "
             f"that filesystem")
    leftover = (f"the leftover {os.path.basename(path)} ({held / 2**30:.2f} GiB) is removed at start-up "
                f"({_first_line(exc)})")
    if is_out_of_space(exc) or needed > free + held:
        short = max(needed - free - held, 0) / 2**30
        room = (f"lower checkpoint.keep_latest_k (the folder holds {checkpoints} checkpoints; the newest is always "
                f"kept)" if checkpoints > 1 else "point checkpoint.folder at a filesystem with room (keep_latest_k "
                f"cannot help: the folder holds {checkpoints} checkpoint{'s' * (checkpoints != 1)} and the newest is "
                f"always kept)")
        free_more = (f"Free at least {short:.2f} GiB more there" if short > 0 else
                     "Free space there (the filesystem reports enough now: a quota or another writer may hold it)")
        return SaveFailedError(errno.ENOSPC, f"no space left on device while saving {path}: {space}; {kept}. "
                                             f"{free_more}, or {room}, and rerun: {leftover}")
    return SaveFailedError(errno.EIO, f"saving {path} failed: {space}; {kept}. Rerun to resume from it: {leftover}")


def commit_failed(error: str, newest_good: str | None) -> SaveFailedError:
    """The one line for a save whose data was written but whose commit (manifest, rename) failed."""
    kept = f"the newest good checkpoint, {newest_good}, is kept" if newest_good else "no checkpoint was saved before"
    return SaveFailedError(errno.EIO, f"{error}; {kept}: free space (or fix the folder) and rerun to resume from it")
