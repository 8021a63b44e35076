"""``train.py --dry-run --world-size N``: every shipped config passes at the world size it is
written for (small stand-ins for its model folder, tokenizer and data), and what a launch
would refuse is refused with one line and exit 2, before anything is started or written."""

import base64
import glob
import json
import os
import re
import subprocess
import sys

import pytest

from hf_fixtures import TEXTS, make_hf_model, make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "train_configs", "*.toml")))


def written_world_size(path: str) -> int:
    """The world size a config is written for: its header's ``torchrun [--nnodes M] --nproc-per-node N``."""
    header = open(path).read().split("\n[", 1)[0]
    nproc = re.search(r"torchrun .*--nproc-per-node (\d+)", header)
    assert nproc, f"{path}: no 'torchrun --nproc-per-node N' line in its header"
    nnodes = re.search(r"--nnodes (\d+)", header)
    return int(nproc.group(1)) * (int(nnodes.group(1)) if nnodes else 1)


def written_device_gib(path: str) -> list[str]:
    """The device a config is written for, where its header names one (``--device-memory-gib G``)."""
    header = open(path).read().split("\n[", 1)[0]
    gib = re.search(r"--device-memory-gib (\d+)", header)
    return ["--device-memory-gib", gib.group(1)] if gib else []


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A tiny Llama folder (config.json, safetensors, tokenizer.json), a tiktoken BPE file and a corpus that fills
    a window of every shipped config (the dry run refuses one that does not, as a launch does)."""
    root = tmp_path_factory.mktemp("stand_ins")
    hf = str(root / "hf")
    make_hf_model(hf, "llama", {})
    make_tokenizer(hf)
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    (root / "tokenizer.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                  for i, t in enumerate(ranks)))
    with open(root / "corpus.jsonl", "w") as f:  # one window of the longest config's seq_len (6M tokens) at least
        for text in TEXTS * 4:
            f.write(json.dumps({"text": text}) + "\n")
        for _ in range(120):
            f.write(json.dumps({"text": " ".join(TEXTS) * 100}) + "\n")
    return {"hf": hf, "tiktoken": str(root / "tokenizer.model"), "corpus": str(root / "corpus.jsonl")}


def overrides_for(path: str, stand_ins: dict, dump: str) -> list[str]:
    """Point the paths a config names at the stand-ins (its other settings as shipped)."""
    text = open(path).read()
    out = ["--job.dump_folder", dump]
    hf = re.search(r"^hf_assets_path\s*=\s*\"([^\"]*)\"", text, flags=re.M)
    if hf and os.path.isfile(os.path.join(ROOT, hf.group(1), "config.json")):  # a config.json shipped in the repo
        # stays (the architecture; no weights: a random init), the tokenizer is the stand-in's
        out += ["--model.hf_assets_path", os.path.join(ROOT, hf.group(1)), "--model.tokenizer_path", stand_ins["hf"]]
    elif hf:
        out += ["--model.hf_assets_path", stand_ins["hf"]]
        if re.search(r"^ulysses_head_stages\s*=", text, flags=re.M):  # the 8B's 32 heads' stages; the stand-in's
            out += ["--parallelism.ulysses_head_stages", "1"]  # 8 heads give one per rank of sp=8
    if re.search(r"^tokenizer_path\s*=", text, flags=re.M):
        out += ["--model.tokenizer_path", stand_ins["tiktoken"]]
    named = re.search(r"^dataset_path\s*=\s*\"([^\"]*)\"", text, flags=re.M)
    if named and not os.path.isfile(os.path.join(ROOT, named.group(1))):  # files shipped in the repo stay
        out += ["--training.dataset_path", stand_ins["corpus"]]
    return out



def test_every_config_has_a_world_size():
    assert len(CONFIGS) >= 6
    assert {os.path.basename(c): written_world_size(c) for c in CONFIGS}["llama3_8b_512k.toml"] == 32


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_passes_the_dry_run(path, stand_ins, train_main, tmp_path):
    world = written_world_size(path)
    dump = str(tmp_path / "run")
    code, out, err = train_main(["--config", path, *overrides_for(path, stand_ins, dump),
                                 "--dry-run", "--world-size", str(world), *written_device_gib(path)])
    assert code == 0, err
    assert out.startswith(f"dry run: {world} rank(s)"), out
    sp = int(re.search(r"^ulysses_degree\s*=\s*(\d+)", open(path).read(), flags=re.M).group(1))
    assert f"'sp': {sp}" in out and "memory per device (estimate)" in out and "weights at the first step" in out
    assert not os.path.exists(dump), "a dry run wrote into job.dump_folder"


def test_the_plan_names_the_model_data_memory_and_saves(stand_ins, train_main, tmp_path):
    path = os.path.join(ROOT, "train_configs", "llama3_8b_128k_from_hf.toml")
    dump = str(tmp_path / "run")
    code, out, err = train_main(["--config", path, *overrides_for(path, stand_ins, dump), "--dry-run",
                                 "--world-size", "8", "--device-memory-gib", "141"])
    assert code == 0, err
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert "LlamaForCausalLM 2 layers, dim 64, 8 heads (2 kv" in lines["model"] and "attention sdpa" in lines["model"]
    assert "131072-token sequence over 8 rank(s) (16384 tokens each)" in lines["layout"]
    assert "global batch 8 = local 1 x dp 1 x 8 microbatch(es)" in lines["layout"]
    assert lines["training data"].startswith(f"text {stand_ins['corpus']}: 1 file(s)")
    assert "first 8 rows tokenize to" in lines["training data"]
    assert "of 141 GiB (--device-memory-gib)" in lines["memory per device (estimate)"]
    for phase in ("loss forward", "loss backward", "layer backward", "embedding backward", "optimizer step"):
        assert phase in lines["memory per device (estimate)"]
    assert lines["checkpoints"].startswith(f"{dump}/checkpoint/step-N every 100 steps and at step 1000")
    assert lines["weights at the first step"] == f"the Hugging Face folder {stand_ins['hf']} (its safetensors)"


def test_packed_documents_at_128k_pass_on_sdpa_and_flex(stand_ins, train_main, tmp_path):
    """The shipped 128K config packs documents on sdpa (one causal call per document, no [S, S] mask);
    flex (a block mask) passes too. Both were refused (or needed flex) while sdpa masked densely."""
    path = os.path.join(ROOT, "train_configs", "llama3_8b_128k_from_hf.toml")
    for backend in ("sdpa", "flex"):
        code, out, err = train_main(["--config", path, *overrides_for(path, stand_ins, str(tmp_path / "run")),
                                     "--model.attn_backend", backend, "--dry-run", "--world-size", "8"])
        assert code == 0, (backend, err)
        assert f"attention {backend}" in out, out


def test_a_plan_that_does_not_fit_the_device_is_refused_with_what_fits(train_main):
    path = os.path.join(ROOT, "train_configs", "llama3_8b_128k.toml")
    code, out, err = train_main(["--config", path, "--model.tokenizer", "byte", "--training.dataset", "passkey",
                                 "--dry-run", "--world-size", "8", "--device-memory-gib", "24"])
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("config error: the memory estimate of this config is ") and "recommends" in err[0], err
    assert "more than the device's 24.0 GiB" in err[0], err
    code, out, _ = train_main(["--config", path, "--model.tokenizer", "byte", "--training.dataset", "passkey",
                               "--dry-run", "--world-size", "8", "--device-memory-gib", "80"])
    assert code == 0 and "of 80 GiB (--device-memory-gib)" in out


def test_data_sample_problems_are_refused_with_their_line(stand_ins, train_main, tmp_path):
    base = ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--dry-run", "--world-size", "2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n')
    code, _, err = train_main([*base, "--training.dataset", "text", "--training.dataset_path", str(bad)])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"data error: {bad} line 2: not a JSON object"), err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x " * 300, "completion": "y"}) + "\n")
    code, _, err = train_main([*base, "--training.dataset", "sft", "--training.dataset_path", str(long)])
    assert code == 2 and len(err) == 1 and "is longer than training.seq_len 512" in err[0], err
    assert "training.overlong_samples" in err[0]
    code, _, err = train_main([*base, "--training.dataset", "text", "--training.dataset_path", str(tmp_path / "no")])
    assert code == 2 and err[0].startswith("data error: training.dataset_path") and "does not exist" in err[0], err


def test_a_tokenizer_larger_than_the_model_is_refused(stand_ins, train_main):
    base = ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--dry-run", "--world-size", "2"]
    code, _, err = train_main([*base, "--model.tokenizer", "tiktoken", "--model.tokenizer_path", stand_ins["tiktoken"]])
    assert code == 2 and err == ["config error: the tokenizer has 516 ids but model.flavor 'debugmodel' has "
                                 "vocab_size 264"], err


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "8"], "--world-size is an option of --dry-run"),
    (["--dry-run", "--world-size", "0"], "--world-size expects a positive int, got '0'"),
    (["--dry-run", "--world-size", "eight"], "--world-size expects a positive int, got 'eight'"),
    (["--dry-run", "--device-memory-gib", "-1"], "--device-memory-gib expects a positive float, got '-1'"),
])
def test_dry_run_options_are_checked(argv, message, train_main):
    code, _, err = train_main(["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), *argv])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"config error: {message}"), err


@pytest.mark.slow
def test_the_command_line_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--dry-run",
                           "--world-size", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: parallelism"), proc.stderr


def test_the_dry_run_refuses_what_a_launch_refuses_once_started(train_main, tmp_path, monkeypatch):
    """A corpus smaller than one window, an output folder that cannot be written, W&B without a login: each
    passed the dry run and stopped the launch (the last two with a traceback or after the process group)."""
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.data.build import build_dataset
    from titan_ulysses.data.sources import DataError
    from titan_ulysses.data.tokenizer import ByteTokenizer

    base = ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--dry-run", "--world-size", "2"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"row {i} " * 10}) + "\n" for i in range(5)))  # 5 rows, 310 tokens
    text = ["--training.dataset", "text", "--training.dataset_path", str(small),
            "--training.dataset_cache_dir", str(tmp_path / "cache")]
    for extra in ([], ["--training.packing", "false", "--training.min_document_tokens", "100"]):
        config = load_config([a for a in base if a not in ("--dry-run", "--world-size", "2")] + text + extra)
        with pytest.raises(DataError) as launch:  # what the launch says, building the dataset
            build_dataset("text", str(small), ByteTokenizer(), config, 0)
        code, _, err = train_main([*base, *text, *extra])
        assert code == 2 and err == [f"data error: {launch.value}"], err
    assert "fewer than one window of training.seq_len = 512" in str(launch.value)
    code, out, err = train_main([*base, *text, "--training.seq_len", "256"])  # 310 tokens: one window
    assert code == 0, err

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").write_text("a file where the tensorboard folder goes")
    dump = ["--job.dump_folder", str(tmp_path / "run")]
    code, _, err = train_main([*base, *dump, "--metrics.enable_tensorboard", "true"])
    assert code == 2 and err == [f"config error: metrics.enable_tensorboard: its tensorboard folder "
                                 f"'{tmp_path / 'run' / 'tb'}' is a file, not a folder; name a folder (it is created "
                                 f"if missing); or set metrics.enable_tensorboard false"], err
    assert train_main([*base, *dump])[0] == 0

    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.chdir(tmp_path)
    pytest.importorskip("wandb")  # metrics.enable_wandb without the package is refused by validate
    code, _, err = train_main([*base, "--metrics.enable_wandb", "true"])
    assert code == 2 and err == [f"config error: metrics.enable_wandb: no W&B login for api.wandb.ai (no "
                                 f"WANDB_API_KEY, no api.wandb.ai entry in {tmp_path / 'home' / '.netrc'}); run `wandb "
                                 f"login`, or set WANDB_MODE=offline (sync later with `wandb sync`) or "
                                 f"metrics.enable_wandb false"], err
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert train_main([*base, "--metrics.enable_wandb", "true"])[0] == 0
    (tmp_path / "home" / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert train_main([*base, "--metrics.enable_wandb", "true"])[0] == 0
