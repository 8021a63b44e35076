"""A layer's statistics beside its output: the contract between the decoder's blocks and what runs them.

A unit the decoder runs in turn returns ``h [B, S, D]`` or ``(h, stats)`` (a mixture of
experts' router statistics, ``models/moe/feed_forward.py``). The model's forward and the
activation checkpoint groups (``distributed/activation_checkpoint.py``) both sum them with
:func:`add_stats`, so it lives below both.
"""

from __future__ import annotations

__all__ = ["add_stats"]


def add_stats(total, out):
    """A unit's output -> ``(h, total + its stats)`` (``total`` None until a unit has stats)."""
    if not isinstance(out, tuple):
        return out, total
    h, stats = out
    return h, stats if total is None else total + stats
