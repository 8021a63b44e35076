"""Output folders a run writes into (``job.dump_folder``, its ``tb`` folder): refused before any
process group when they cannot be folders, instead of a traceback from ``os.makedirs`` later."""

from __future__ import annotations

import os


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
    return None


def output_folders_problem(config) -> str | None:
    """``job.dump_folder``, and with ``metrics.enable_tensorboard`` its ``tb`` folder, as folders a run can write."""
    dump = config.job.dump_folder
    problem = output_folder_problem("job.dump_folder", dump)
    if problem or not config.metrics.enable_tensorboard:
        return problem
    problem = output_folder_problem("its tensorboard folder", os.path.join(dump, "tb"))
    return f"metrics.enable_tensorboard: {problem}; or set metrics.enable_tensorboard false" if problem else None
