"""Whether a checkpoint of this run's folder fits the run, decided before anything is loaded.

A resume reads the settings the checkpoint was saved with (``train_state.settings``, a few
hundred bytes) and compares them with the config (``config/resume.py``'s ``resume_changes``)
before the load, and checks the model's keys and shapes against the checkpoint's ``.metadata``.
A checkpoint that does not fit is a good checkpoint of other settings: the run is refused
with one line naming them, and the checkpoint is never set aside as damaged (issue 38: a
relaunch with another ``model.flavor`` renamed every good checkpoint ``step-N.bad``).

``check_resume`` is preflight's (before any process group, the same answer in ``--dry-run``);
``model_mismatch`` is the manager's, for each checkpoint it is about to load.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_ulysses.checkpoint.errors import RunRefused
from titan_ulysses.checkpoint.steps import complete_steps

NEW_RUN = "or train these settings from the start in another job.dump_folder (or checkpoint.folder)"


# a verified checkpoint whose load fails like this is of other settings, never damage
_MISMATCH = re.compile(r"^.*(size mismatch|missing key|unexpected key|shape).*$", re.I | re.M)
DOES_NOT_FIT = "loading failed on a mismatch: "
CODE_ERROR = "loading failed in the code: "
# what torch's zip reader says of a file it cannot read (a RuntimeError, not an OSError)
_UNREADABLE = re.compile(r"PytorchStreamReader failed|failed finding central directory|unexpected EOF", re.I)


class SettingsMismatchError(RunRefused):
    """A good checkpoint of this run's folder was written with settings this run cannot load."""


class LoadCodeError(RunRefused):
    """A verified checkpoint failed to load on a code error (not a file read): the run stops, nothing is set aside."""


def saved_settings(path: str) -> dict | None:
    """The settings ``path`` was saved with (read alone, without a process group); None when it has
    none (written before the record existed) or they cannot be read (verification then says why)."""
    state = {"train_state": {"settings": ""}}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
        text = state["train_state"]["settings"]
        return json.loads(text) if text else None
    except Exception:  # noqa: BLE001 (a damaged file: the manager's verification names it)
        return None


def model_mismatch(path: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """How the model weights of checkpoint ``path`` differ from ``shapes`` (``model.``-prefixed keys ->
    global shape, this run's), or None when every key is there with its shape."""
    saved = {k: tuple(m.size) for k, m in FileSystemReader(path).read_metadata().state_dict_metadata.items()
             if k.startswith("model.") and hasattr(m, "size")}
    missing = sorted(set(shapes) - set(saved))
    if missing:
        return f"{len(missing)} weight(s) of this run's model are not in it ({missing[0]}, ...)"
    extra = sorted(set(saved) - set(shapes))
    if extra:
        return f"it holds {len(extra)} weight(s) this run's model has not ({extra[0]}, ...)"
    for key, shape in sorted(shapes.items()):
        if saved[key] != tuple(shape):
            return f"{key} is {list(saved[key])} there, {list(shape)} in this run's model"
    return None


def model_shapes(model) -> dict[str, tuple[int, ...]]:
    """The model's weights as a checkpoint keys them (``model.`` + FQN) -> global shape (no communication)."""
    return {f"model.{k}": tuple(v.size()) for k, v in get_model_state_dict(model).items()}


def _is_read_error(error: BaseException) -> bool:
    """A file of the checkpoint could not be read (an I/O error, a file cut short, bytes that do not unpickle
    or unzip): damage. Anything else raised while loading is the code's (issue 43)."""
    from titan_ulysses.checkpoint.safety import exceptions

    return any(isinstance(e, (OSError, EOFError, pickle.UnpicklingError)) or _UNREADABLE.search(str(e))
               for e in exceptions(error))


def load_failure(error: BaseException) -> str:
    """The reason of a failed load of a verified checkpoint: it starts with ``DOES_NOT_FIT`` when the load failed
    on a key or a shape (other settings), with ``CODE_ERROR`` when no file read failed (a code error, e.g. fused
    AdamW refusing a layout's parameters while the optimizer state is set up: the files are sound); only
    the rest, a failed file read, is damage the manager sets aside."""
    hit = _MISMATCH.search(str(error))
    if hit:
        return f"{DOES_NOT_FIT}{hit.group(0).strip()[:300]}"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    if not _is_read_error(error):
        return f"{CODE_ERROR}{type(error).__name__}: {first}"
    return f"loading failed: {type(error).__name__}: {str(error).strip()[:500]}"


def code_error_refusal(path: str, reason: str) -> LoadCodeError:
    """The one line for a verified checkpoint whose load failed in the code, not in its files."""
    return LoadCodeError(
        f"checkpoint {path} passed verification, but loading it failed in the code, not in its files "
        f"({reason.removeprefix(CODE_ERROR)}); nothing was set aside, renamed or changed: resume at the layout "
        f"and version it was saved with, or report the error with this line")


def mismatch_refusal(path: str, reason: str, saved: dict | None, current: dict | None) -> SettingsMismatchError:
    """The one line for a checkpoint that does not fit: what differs, the settings that differ, what to do."""
    from titan_ulysses.config.resume import MODEL_SETTINGS

    changed = [f"{k} {saved[k]!r} -> {v!r}" for k, v in (current or {}).items()
               if saved and k in saved and saved[k] != v and k in MODEL_SETTINGS]
    settings = f" (settings changed: {', '.join(changed)})" if changed else ""
    return SettingsMismatchError(
        f"checkpoint {path} is good but does not fit this run's model: {reason}{settings}; nothing was loaded or "
        f"set aside: set the settings back to resume, {NEW_RUN}")


def check_resume(config, args) -> None:
    """Preflight: the checkpoint a launch would resume (the folder's newest) against this config. Raises
    ConfigError (a model setting changed without ``checkpoint.override_recorded``) or SettingsMismatchError
    (its model's shapes are not ``args``'), naming the settings and what to do; nothing is read otherwise."""
    from titan_ulysses.config.resume import overrides, resume_changes, resume_settings
    from titan_ulysses.interop.hf_export import check_dcp_model_shapes

    c = config.checkpoint
    folder = os.path.join(config.job.dump_folder, c.folder)
    steps = complete_steps(folder) if c.enable else []
    if not steps:
        return
    path = os.path.join(folder, f"step-{steps[-1]}")
    try:
        FileSystemReader(path).read_metadata()
    except Exception:  # noqa: BLE001 (damage, not settings: the launch's verification names it and falls back)
        return
    saved, current = saved_settings(path), resume_settings(config)
    resume_changes(saved, current, overrides(config))
    try:
        check_dcp_model_shapes(path, args)
    except ValueError as e:  # an unreadable .metadata (OSError) is damage: the launch's verification names it
        raise mismatch_refusal(path, str(e), saved, current) from None
