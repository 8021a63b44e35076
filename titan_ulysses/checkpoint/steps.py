"""The ``step-N`` folders of a checkpoint folder: which are complete, and why a named one is not."""

from __future__ import annotations

import os
import re

STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint in ``folder``, ascending (``.tmp`` leftovers never count)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        match = STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


def missing_checkpoint(path: str, setting: str = "checkpoint.initial_load_path") -> str | None:
    """Why ``path`` is not a complete checkpoint (naming the steps that do exist beside it), or None."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return None
    parent = os.path.dirname(os.path.normpath(path))
    steps = complete_steps(parent)
    there = (f"the complete checkpoints in {parent} are {', '.join(f'step-{s}' for s in steps)}" if steps
             else f"{parent} holds no complete checkpoint")
    if not os.path.exists(path):
        return f"{path!r} does not exist; {there}"
    return f"{path!r} is not a complete checkpoint (no .metadata); point {setting} at a step-N folder; {there}"
