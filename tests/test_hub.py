"""``model.hf_assets_path`` as a Hub id, offline: a Hub cache laid out under a temporary HF_HOME
(blobs, snapshots, refs) for a tiny model folder; the id reads what the folder reads, a revision
picks its snapshot, and a missing id / revision is one line naming it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from hf_fixtures import make_hf_model, make_tokenizer
from titan_ulysses.interop import hub
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.models.resolve import model_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-llama"
MAIN, V1 = "a" * 40, "b" * 40


def lay_out_snapshot(hub_cache: str, repo_id: str, folder: str, commit: str, refs: tuple[str, ...]) -> str:
    """``folder``'s files as huggingface_hub caches them: blobs by hash, the snapshot's links, the refs."""
    repo = os.path.join(hub_cache, "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        data = open(os.path.join(folder, name), "rb").read()
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
    for ref in refs:
        os.makedirs(os.path.dirname(os.path.join(repo, "refs", ref)), exist_ok=True)
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snap


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """(HF_HOME, the model folder): the folder at ``main``, a 1-layer sibling at tag ``v1``."""
    pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("hub")
    folder, older = str(base / "folder"), str(base / "older")
    for path, layers in ((folder, 2), (older, 1)):
        make_tokenizer(path)
        make_hf_model(path, "llama", dict(num_hidden_layers=layers, tie_word_embeddings=True), bos_token_id=0,
                      eos_token_id=1)
    home = str(base / "hf_home")
    lay_out_snapshot(os.path.join(home, "hub"), REPO, folder, MAIN, ("main",))
    lay_out_snapshot(os.path.join(home, "hub"), REPO, older, V1, ("v1",))
    return home, folder


@pytest.fixture
def offline(hub_home, monkeypatch):
    """huggingface_hub reads its settings at import: the in-process tests set its constants too."""
    from huggingface_hub import constants

    home, _ = hub_home
    for name, value in (("HF_HOME", home), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(home, "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return hub_home


def _config(*argv):
    return load_config(["--model.tokenizer", "hf", *argv])


def test_hub_id_reads_the_cached_snapshot(offline):
    home, folder = offline
    config = _config("--model.hf_assets_path", REPO)
    resolved = hub.resolve_hf_assets(config)
    assert resolved.repo_id == REPO and resolved.commit == MAIN
    assert config.model.hf_assets_path == os.path.join(home, "hub", "models--tiny-org--tiny-llama", "snapshots", MAIN)
    for name in os.listdir(folder):
        assert open(os.path.join(folder, name), "rb").read() == open(
            os.path.join(config.model.hf_assets_path, name), "rb").read(), name
    assert model_args(config) == model_args(_config("--model.hf_assets_path", folder))
    assert hub.hub_id_of(config.model.hf_assets_path) == REPO and hub.hub_id_of(folder) is None
    assert hub.resolve_hf_assets(config) is None  # once resolved, a folder: nothing more to do


def test_revision_by_tag_and_by_commit(offline):
    for revision in ("v1", V1):
        config = _config("--model.hf_assets_path", REPO, "--model.hf_revision", revision)
        assert hub.resolve_hf_assets(config).commit == V1
        assert model_args(config).n_layers == 1


@pytest.mark.parametrize("argv, expected", [
    (["--model.hf_assets_path", "nobody/nothing"],
     "model.hf_assets_path 'nobody/nothing' is not in the Hub cache"),
    (["--model.hf_assets_path", REPO, "--model.hf_revision", "v9"],
     f"model.hf_assets_path '{REPO}' at revision 'v9' is not in the Hub cache"),
    (["--model.hf_assets_path", "not/a/hub/id"], "is neither a folder on this machine nor a Hub id"),
    (["--model.hf_revision", "v1"], "model.hf_revision 'v1' selects a revision of a Hub id, but"),
])
def test_refusals_name_the_setting_in_one_line(offline, argv, expected):
    with pytest.raises(ConfigError) as e:
        hub.resolve_hf_assets(_config(*argv))
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    if "cache" in expected:
        assert "hf download" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_hub_errors_become_one_line(offline, monkeypatch):
    """What an online Hub answers (gated, not found), with snapshot_download made to raise it."""
    import huggingface_hub
    from huggingface_hub import errors

    def raising(error):
        def fake(*args, **kwargs):
            raise error
        return fake

    import httpx

    def answer(status):
        return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/gated"))

    cases = [(errors.GatedRepoError("401 gated", response=answer(401)), "is a gated model: accept its terms"),
             (errors.RepositoryNotFoundError("404", response=answer(404)), "no such model on the Hub, or a private one"),
             (errors.RevisionNotFoundError("404 rev", response=answer(404)), "no such revision")]
    for error, expected in cases:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(error))
        with pytest.raises(ConfigError) as e:
            hub.resolve_hf_assets(_config("--model.hf_assets_path", "org/gated"))
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_local_ranks_open_local_rank_0s_commit(offline, monkeypatch):
    """Under torchrun the node's other ranks wait for local rank 0's marker and read its commit offline."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-hub")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(os.getpid()))  # this test's launch only
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(hub, "WAIT_POLL_S", 0.01)
    with pytest.raises(ConfigError, match="local rank 0 did not finish downloading it within"):
        hub.resolve_hf_assets(_config("--model.hf_assets_path", REPO), timeout_s=0.05)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert hub.resolve_hf_assets(_config("--model.hf_assets_path", REPO)).commit == MAIN
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = []
    real = hub._snapshot
    monkeypatch.setattr(hub, "_snapshot", lambda *a, **k: calls.append((a, k)) or real(*a, **k))
    assert hub.resolve_hf_assets(_config("--model.hf_assets_path", REPO)).commit == MAIN
    assert calls == [((REPO, MAIN), {"local_only": True})]
    os.remove(hub._marker_path(REPO, None))


def _single_rank_env(**extra) -> dict:
    """A world of one on a free port: plain `python train.py` would take 29500, which other runs may hold."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
            "PYTHONPATH": ROOT, **extra}


def _train(home, model, dump, *extra):
    env = _single_rank_env(HF_HOME=home, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "train.py", "--model.hf_assets_path", model, "--model.tokenizer", "hf",
           "--parallelism.ulysses_degree", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--training.steps", "2", "--training.passkey_digits", "1", "--training.mixed_precision_param", "float32",
           "--checkpoint.enable", "false", "--metrics.log_freq", "1", "--job.dump_folder", str(dump), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_from_hub_id_equals_from_folder(hub_home, tmp_path):
    home, folder = hub_home
    lora = ["--lora.rank", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    by_id, by_folder = _train(home, REPO, tmp_path / "id", *lora), _train(home, folder, tmp_path / "folder", *lora)
    assert by_id.returncode == 0 and by_folder.returncode == 0, by_id.stderr[-2000:] + by_folder.stderr[-2000:]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("id", "folder")]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses  # bit for bit: the same weights
    # the LoRA export names the base as it was given: the Hub id, for peft to fetch
    out = tmp_path / "adapter"
    export = subprocess.run([sys.executable, "scripts/export_hf.py", "--checkpoint", str(tmp_path / "id" / "checkpoint"
                             / "step-2"), "--output", str(out), "--adapter-only"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == REPO
    missing = _train(home, "nobody/nothing", tmp_path / "missing")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines() == [missing.stderr.strip()] and "'nobody/nothing'" in missing.stderr
    dry = _train(home, REPO, tmp_path / "dry", "--dry-run", "--world-size", "1")
    assert dry.returncode == 0 and "models--tiny-org--tiny-llama" in dry.stdout, dry.stderr[-2000:]
    shutil.rmtree(tmp_path / "id", ignore_errors=True)


@pytest.mark.slow
def test_torchrun_ranks_share_local_rank_0s_snapshot(hub_home, tmp_path):
    """Two ranks under torchrun, offline: rank 1 waits for rank 0's marker and reads the same snapshot."""
    home, _ = hub_home
    env = {**os.environ, "HF_HOME": home, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--model.hf_assets_path", REPO, "--model.tokenizer", "hf", "--parallelism.ulysses_degree", "2",
           "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "1",
           "--training.passkey_digits", "1", "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"weights from the Hugging Face folder {home}/hub/models--tiny-org--tiny-llama/snapshots/{MAIN}" in (
        proc.stdout)
