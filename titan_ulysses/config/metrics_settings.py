"""The ``[metrics]`` strings (W&B names and tags) and the wandb package, checked before any process group."""

from __future__ import annotations

import importlib.util

PROJECT_FORBIDDEN = "/\\#?%:"  # W&B refuses these in project names
MAX_PROJECT = 128
MAX_TAG = 64


def check_metrics(m) -> str | None:
    """The refusal for the ``[metrics]`` section ``m``, or None."""
    if not m.enable_wandb:
        return None
    if importlib.util.find_spec("wandb") is None:
        return ("metrics.enable_wandb needs the wandb package, which is not installed: "
                "pip install 'titan_ulysses[wandb]' (or pip install wandb), or set metrics.enable_wandb false")
    project = m.wandb_project
    if not project.strip() or len(project) > MAX_PROJECT or any(c in project for c in PROJECT_FORBIDDEN):
        return (f"metrics.wandb_project {project!r} must be 1 to {MAX_PROJECT} characters without any of "
                f"{' '.join(PROJECT_FORBIDDEN)}")
    if m.wandb_entity and any(c in m.wandb_entity for c in PROJECT_FORBIDDEN + " "):
        return f"metrics.wandb_entity {m.wandb_entity!r} must be a W&B user or team name (no spaces or {PROJECT_FORBIDDEN})"
    if len(m.wandb_run_name) > MAX_PROJECT:
        return f"metrics.wandb_run_name must be at most {MAX_PROJECT} characters, got {len(m.wandb_run_name)}"
    parts = m.wandb_tags.split(",") if m.wandb_tags.strip() else []
    for tag in parts:
        if not tag.strip():
            return f"metrics.wandb_tags {m.wandb_tags!r} has an empty tag; write tags as \"a,b,c\""
        if len(tag.strip()) > MAX_TAG:
            return f"metrics.wandb_tags: tag {tag.strip()!r} is longer than {MAX_TAG} characters"
    return None
