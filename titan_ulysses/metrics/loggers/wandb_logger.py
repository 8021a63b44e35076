"""Weights & Biases: one run per dump folder, continued when the training run resumes.

``WANDB_MODE`` is wandb's own switch (``offline``: no network, ``wandb sync`` later;
``disabled``: nothing). The run files go under ``{dump_folder}/wandb``; the run id is kept
in ``{dump_folder}/wandb/run_id`` so that a resume from this folder's checkpoint logs into
the same run. The job's whole config is the run's config.
"""

from __future__ import annotations

import os
import secrets
import string

from titan_ulysses.metrics.loggers.base import numeric

RUN_ID_FILE = "run_id"


class WandbError(RuntimeError):
    """wandb.init failed (no login, no network): one line naming the setting and the fixes."""


def run_id(dump_folder: str, resumed: bool) -> str:
    """The id of this folder's W&B run when the training run resumes; a new one (recorded) otherwise."""
    folder = os.path.join(dump_folder, "wandb")
    path = os.path.join(folder, RUN_ID_FILE)
    if resumed and os.path.isfile(path):
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id form
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(new + "\n")
    os.replace(path + ".tmp", path)
    return new


class WandbLogger:
    def __init__(self, dump_folder: str, settings, run_config: dict, resumed: bool):
        import wandb

        tags = [t.strip() for t in settings.wandb_tags.split(",") if t.strip()]
        rid = run_id(dump_folder, resumed)
        try:
            self.run = wandb.init(
                project=settings.wandb_project, entity=settings.wandb_entity or None,
                name=settings.wandb_run_name or os.path.basename(os.path.abspath(dump_folder)),
                tags=tags or None, config=run_config, dir=os.path.abspath(dump_folder),
                id=rid, resume="allow",
            )
        except Exception as e:  # wandb raises its own (UsageError, CommError, ...) types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise WandbError(f"metrics.enable_wandb: wandb.init failed ({first}); run `wandb login`, or set "
                             f"WANDB_MODE=offline (sync later with `wandb sync`) or metrics.enable_wandb false") from e

    def log(self, metrics: dict) -> None:
        self.run.log(numeric(metrics), step=metrics["step"])

    def log_summary(self, summary: dict) -> None:
        for key, value in summary.items():
            if value is not None:
                self.run.summary[f"run/{key}"] = value

    def close(self) -> None:
        self.run.finish()
