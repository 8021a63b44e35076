"""The shipped configs: ``--config NAME`` from any folder.

They are the repository's ``train_configs/*.toml``, seen by the package through the symlink
``titan_ulysses/configs`` (one copy of each file; a wheel holds them as package data, pyproject.toml).
Paths inside a config (``job.dump_folder``, ``./data``, ``./assets``) stay relative to the working directory.
"""

from __future__ import annotations

import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def shipped_configs() -> dict[str, str]:
    """name (the file's name without .toml) -> path, sorted by name."""
    try:
        names = sorted(os.listdir(CONFIG_DIR))
    except OSError:
        return {}
    return {name[: -len(".toml")]: os.path.join(CONFIG_DIR, name) for name in names if name.endswith(".toml")}


def config_path(value: str) -> str | None:
    """``--config``'s value as a file to read: the value itself when it is a file, else the shipped config it names
    (``debug_model``, ``debug_model.toml`` or ``train_configs/debug_model.toml`` outside the repository), else None."""
    if os.path.isfile(value):
        return value
    name = value.removeprefix("train_configs/").removesuffix(".toml")
    return shipped_configs().get(name) if os.sep not in name and "/" not in name else None


def not_found(value: str) -> str:
    """The one-line refusal for a ``--config`` that is neither a file nor a shipped config."""
    names = ", ".join(shipped_configs()) or "none found: the package's configs folder is missing"
    if os.path.isdir(value):  # "no such file" would mislead: it is there, as a folder
        tomls = sorted(n for n in os.listdir(value) if n.endswith(".toml"))
        there = (f"the TOML files there: {', '.join(tomls[:8])}{', ...' if len(tomls) > 8 else ''} (e.g. --config "
                 f"{os.path.join(value, tomls[0])})" if tomls else "it holds no .toml file")
        return f"--config {value} is a folder, not a TOML file; {there}; or a shipped config: {names}"
    return f"--config {value}: cannot read the file (no such file), nor is it a shipped config (shipped: {names})"
