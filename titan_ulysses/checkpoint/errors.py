"""Refusals of the checkpoint side that end a run with one line and exit code 2 (``train.py``)."""


class RunRefused(RuntimeError):
    """The run must not start as configured (its folder is in use, its checkpoints are all damaged)."""
