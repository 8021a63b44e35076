"""``model.hf_assets_path`` as a Hugging Face Hub id (``Qwen/Qwen3-8B``): the local snapshot folder.

``resolve_hf_assets(config)`` is called once per entry point, before anything reads the folder
(the launch checks, the dry run, the scripts). An existing folder stays as it is. An ``org/name``
that is not a folder goes through ``huggingface_hub.snapshot_download`` (its cache under
``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``), at ``model.hf_revision`` when set, and the setting
becomes the snapshot folder; ``hub_id_of`` gives the id back from it (the LoRA record's base model).

Under torchrun, local rank 0 of each node downloads and writes the commit it got to a marker
keyed by the launch (host, torchrun agent's pid, restart count); the node's other ranks wait for
it and open that same commit from the cache without the network, so every rank of a node reads
one snapshot even if the branch moves meanwhile. Without torchrun, each process resolves on its
own (``snapshot_download`` locks each file it writes). Every failure is one ConfigError line
naming the id and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass

from titan_ulysses.config.manager import ConfigError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "tokenizer*", "*.txt", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[0-9a-f]{40}/?$")
WAIT_POLL_S = 0.5
MARKER_KEEP_S = 86400


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None
    commit: str
    folder: str


def hub_id_of(folder: str) -> str | None:
    """``org/name`` when ``folder`` is a snapshot of the Hub cache, else None."""
    match = _SNAPSHOT.search(os.path.abspath(folder)) if folder else None
    return f"{match.group(1)}/{match.group(2)}" if match else None


def resolve_hf_assets(config, timeout_s: float | None = None) -> HubModel | None:
    """Turn a Hub id in ``model.hf_assets_path`` into its local snapshot folder (set in place);
    None when the setting is a folder or empty. A ConfigError line otherwise."""
    m = config.model
    path, revision = m.hf_assets_path, m.hf_revision or None
    if not path or os.path.isdir(path):
        if revision:
            raise ConfigError(f"model.hf_revision {revision!r} selects a revision of a Hub id, but model.hf_assets_path "
                              f"{path!r} is {'a local folder' if path else 'not set'}; unset model.hf_revision")
        return None
    if not _HUB_ID.match(path):
        raise ConfigError(f"model.hf_assets_path {path!r} is neither a folder on this machine nor a Hub id "
                          f"(org/name, e.g. Qwen/Qwen3-8B)")
    if timeout_s is None:
        timeout_s = float(config.comm.init_timeout_seconds)
    commit, folder = _node_snapshot(path, revision, timeout_s)
    m.hf_assets_path = folder
    return HubModel(path, revision, commit, folder)


def _node_snapshot(repo_id: str, revision: str | None, timeout_s: float) -> tuple[str, str]:
    """(commit, folder): downloaded by local rank 0 under torchrun, the others open its commit."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "TORCHELASTIC_RUN_ID" not in os.environ or local_world == 1:
        return _snapshot(repo_id, revision)
    marker = _marker_path(repo_id, revision)
    if local_rank == 0:
        try:
            commit, folder = _snapshot(repo_id, revision)
            _write_marker(marker, {"commit": commit})
            return commit, folder
        except ConfigError as e:
            _write_marker(marker, {"error": str(e)})
            raise
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise ConfigError(f"model.hf_assets_path {repo_id!r}: local rank 0 did not finish downloading it within "
                              f"comm.init_timeout_seconds ({timeout_s:.0f} s); download it first (`hf download "
                              f"{repo_id}`) or raise comm.init_timeout_seconds")
        time.sleep(WAIT_POLL_S)
    with open(marker) as f:
        record = json.load(f)
    if "error" in record:
        raise ConfigError(record["error"])
    return _snapshot(repo_id, record["commit"], local_only=True)


def _marker_path(repo_id: str, revision: str | None) -> str:
    """Unique to this launch on this host: torchrun's agent (every local rank's parent) and its restart."""
    launch = [socket.gethostname(), os.getppid(), os.environ.get("TORCHELASTIC_RUN_ID"),
              os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), repo_id, revision]
    name = hashlib.sha256(json.dumps(launch).encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), "titan_ulysses_hub", f"{name}.json")


def _write_marker(path: str, record: dict) -> None:
    """Atomically, so a waiting rank never reads half of it; markers older than a day are removed."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        try:
            if time.time() - os.path.getmtime(os.path.join(folder, name)) > MARKER_KEEP_S:
                os.remove(os.path.join(folder, name))
        except OSError:
            pass  # another node's rank 0 removed it first
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _snapshot(repo_id: str, revision: str | None, local_only: bool = False) -> tuple[str, str]:
    """``snapshot_download`` of the model files; its errors as one line naming the id."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub import errors as hub_errors
    except ImportError as e:  # pragma: no cover - installed with transformers / listed in pyproject
        raise ConfigError(f"model.hf_assets_path {repo_id!r} is a Hub id, which needs huggingface_hub: "
                          f"pip install huggingface_hub") from e
    offline = constants.HF_HUB_OFFLINE
    local_only = local_only or offline  # a commit id would otherwise still ask the Hub for its file list
    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                   local_files_only=local_only)
    except hub_errors.GatedRepoError as e:
        raise ConfigError(f"model.hf_assets_path {repo_id!r} is a gated model: accept its terms on "
                          f"https://huggingface.co/{repo_id} and log in (`hf auth login`, or set HF_TOKEN)") from e
    except hub_errors.RevisionNotFoundError as e:
        raise ConfigError(f"model.hf_revision {revision!r}: no such revision (branch, tag or commit) of "
                          f"{repo_id!r} on the Hub") from e
    except hub_errors.RepositoryNotFoundError as e:
        raise ConfigError(f"model.hf_assets_path {repo_id!r}: no such model on the Hub, or a private one "
                          f"(log in: `hf auth login`, or set HF_TOKEN)") from e
    except hub_errors.LocalEntryNotFoundError as e:
        cache = constants.HF_HUB_CACHE
        if offline or local_only:
            raise ConfigError(f"model.hf_assets_path {repo_id!r}{at} is not in the Hub cache {cache} and "
                              f"HF_HUB_OFFLINE is set: download it first (`hf download {repo_id}`, same HF_HOME) "
                              f"or unset HF_HUB_OFFLINE") from e
        raise ConfigError(f"model.hf_assets_path {repo_id!r}{at}: the Hub cannot be reached and the model is not "
                          f"in the Hub cache {cache}: download it where there is a network (`hf download "
                          f"{repo_id}`, same HF_HOME) or give its folder") from e
    except (hub_errors.HfHubHTTPError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.hf_assets_path {repo_id!r}{at}: {first}") from e
    commit = os.path.basename(os.path.normpath(folder))
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(f"model.hf_assets_path {repo_id!r}{at} has no config.json: not a transformers model "
                          f"repository")
    return commit, folder
