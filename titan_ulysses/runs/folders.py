"""Output folders a run writes into (``job.dump_folder``, ``checkpoint.folder``, the ``tb`` folder): refused
before any process group (and in ``--dry-run``) when they cannot be folders or cannot be created, instead of a
traceback from ``os.makedirs`` later. Creation is tried in a scratch folder removed at once: as root, or on
/proc or a read-only mount, ``os.access`` says yes to folders that cannot be made."""

from __future__ import annotations

import os
import shutil
import tempfile


def output_folder_problem(key: str, path: str) -> str | None:
    """Why ``path`` (the setting ``key``) cannot be created or written as a folder, or None."""
    if not path:
        return f"{key} is empty; name a folder (created if missing)"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):  # the nearest part of the path that exists
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        if probe == os.path.abspath(path):
            return f"{key} {path!r} is a file, not a folder; name a folder (it is created if missing)"
        return f"{key} {path!r} cannot be created: {probe} in its path is a file; name another folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{key} {path!r}: {probe} is not writable by this user; name a folder you can write"
    try:  # what access() cannot tell (root, /proc, a read-only mount, a name too long): create it, to be sure
        missing = os.path.relpath(os.path.abspath(path), probe)
        trial = tempfile.mkdtemp(prefix=".probe-", dir=probe)
        try:
            if missing != ".":
                os.makedirs(os.path.join(trial, missing))
        finally:
            shutil.rmtree(trial, ignore_errors=True)
    except OSError as e:
        return f"{key} {path!r} cannot be created in {probe} ({e.strerror or e}); name a folder you can write"
    return None


def output_folders_problem(config) -> str | None:
    """``job.dump_folder``, ``checkpoint.folder`` (when enabled), with ``metrics.enable_tensorboard`` its ``tb``
    folder, and the ``[profiling]`` folders that are enabled, as folders a run can write."""
    dump = config.job.dump_folder
    problem = output_folder_problem("job.dump_folder", dump)
    if not problem and config.checkpoint.enable:
        problem = output_folder_problem("checkpoint.folder", os.path.join(dump, config.checkpoint.folder))
    if not problem and config.metrics.enable_tensorboard:
        problem = output_folder_problem("its tensorboard folder", os.path.join(dump, "tb"))
        problem = problem and f"metrics.enable_tensorboard: {problem}; or set metrics.enable_tensorboard false"
    p = config.profiling  # the profiler writes from a callback that crashed every rank (SIGSEGV) on a bad folder
    for enabled, key in ((p.enable_profiling, "save_traces_folder"),
                         (p.enable_memory_snapshot, "save_memory_snapshot_folder")):
        if not problem and enabled:
            problem = output_folder_problem(f"profiling.{key}", os.path.join(dump, getattr(p, key)))
    return problem
