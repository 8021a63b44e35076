"""Weights & Biases: one run per dump folder, continued when the training run resumes.

``WANDB_MODE`` is wandb's own switch (``offline``: no network, ``wandb sync`` later;
``disabled``: nothing). The run files go under ``{dump_folder}/wandb``; the run id is kept
in ``{dump_folder}/wandb/run_id`` so that a resume from this folder's checkpoint logs into
the same run. The job's whole config is the run's config. ``login_problem`` is the dry run's
check that a launch's ``wandb.init`` will find a login.
"""

from __future__ import annotations

import os
import secrets
import string

from titan_ulysses.metrics.loggers.base import numeric

RUN_ID_FILE = "run_id"


FIXES = ("run `wandb login`, or set WANDB_MODE=offline (sync later with `wandb sync`) or metrics.enable_wandb "
         "false")
NO_LOGIN_MODES = ("offline", "disabled", "dryrun")


class WandbError(RuntimeError):
    """wandb.init failed (no login, no network): one line naming the setting and the fixes."""


def _settings_value(key: str, environ) -> str:
    """``key`` of wandb's settings files (the folder's own, then the user's: where `wandb offline` writes)."""
    import configparser

    user = environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    for path in (os.path.join("wandb", "settings"), os.path.join(user, "settings")):
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.get("default", key, fallback=""):
            return parser.get("default", key)
    return ""


def login_problem(environ=None) -> str | None:
    """Why ``wandb.init`` would fail for want of a login, or None; read without wandb or the network.

    The sources are wandb's: ``WANDB_MODE`` (or its settings file's ``mode``) offline / disabled,
    ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, the ``.netrc`` entry of ``WANDB_BASE_URL``'s
    host (``NETRC`` or ``~/.netrc``), and an ``api_key`` in its settings file.
    """
    import netrc
    from urllib.parse import urlparse

    environ = os.environ if environ is None else environ
    mode = (environ.get("WANDB_MODE") or _settings_value("mode", environ)).lower()
    if mode in NO_LOGIN_MODES or environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        if netrc.netrc(path).authenticators(host):
            return None
    except (OSError, netrc.NetrcParseError):
        pass
    if _settings_value("api_key", environ):
        return None
    return f"metrics.enable_wandb: no W&B login for {host} (no WANDB_API_KEY, no {host} entry in {path}); {FIXES}"


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
            raise WandbError(f"metrics.enable_wandb: wandb.init failed ({first}); {FIXES}") from e

    def log(self, metrics: dict) -> None:
        self.run.log(numeric(metrics), step=metrics["step"])

    def log_summary(self, summary: dict) -> None:
        for key, value in summary.items():
            if value is not None:
                self.run.summary[f"run/{key}"] = value

    def close(self) -> None:
        self.run.finish()
