"""What a resume may change: the config wins over the checkpoint for these settings.

They are saved with each checkpoint (``checkpoint/state.py``'s ``TrainState``) so that a
resumed run can say what its config changed.
"""

from __future__ import annotations

from titan_ulysses.config.job_config import JobConfig

RESUME_SETTINGS = (
    "optimizer.lr", "optimizer.weight_decay", "optimizer.eps", "optimizer.beta1", "optimizer.beta2",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor", "training.steps", "training.max_norm",
)


def resume_settings(config: JobConfig) -> dict:
    """The config's values of ``RESUME_SETTINGS``, keyed ``section.key``."""
    return {key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in RESUME_SETTINGS}


def settings_changes(saved: dict | None, current: dict) -> str:
    """``key old -> new, ...`` for the settings the config changes from the checkpoint's."""
    if saved is None:
        return "the checkpoint records no settings; the config's apply"
    changed = [f"{k} {saved[k]} -> {v}" for k, v in current.items() if k in saved and saved[k] != v]
    return "the config changes " + ", ".join(changed) if changed else "settings as in the checkpoint"
