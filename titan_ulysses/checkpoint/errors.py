"""Refusals of the checkpoint side that end a run with one line and exit code 2 (``train.py``)."""


class RunRefused(RuntimeError):
    """The run must not start as configured (its folder is in use, its checkpoints are all damaged)."""


class SaveFailedError(OSError):
    """A checkpoint save failed (a full disk, an I/O error); the last good checkpoint is kept. ``strerror``
    is the one line ``train.py`` prints (where, the space needed and free, what to do)."""
