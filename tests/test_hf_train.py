"""From a Hugging Face folder through train.py and back: the first loss is the HF model's, the export loads in
transformers with the same tensors; the HF tokenizer's ids; --help; refusals that name the setting."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_fixtures import TEXTS, make_hf_model, make_tokenizer
from helpers import add_manifest
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import check_files, validate
from titan_ulysses.interop.hf_tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ, BATCH = 64, 4


def _data(folder, seed):
    """The trainer's own first global batch (passkey data, dp = 1), and more batches from another seed."""
    from titan_ulysses.data.datasets import PasskeyDataset
    from titan_ulysses.data.loader import build_dataloader

    tok = HFTokenizer(folder)
    loader = build_dataloader(PasskeyDataset(tok, SEQ, seed, digits=1), global_batch_size=BATCH,
                              local_batch_size=BATCH, dp_rank=0, dp_size=1)
    return iter(loader)


def _hf_loss(model, batch):
    logits = model(batch["input"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama (tied, GQA, llama3 RoPE) trained on passkey data in the test, saved with its tokenizer."""
    folder = str(tmp_path_factory.mktemp("trained") / "hf")
    make_tokenizer(folder)
    rope = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    model = make_hf_model(folder, "llama", dict(tie_word_embeddings=True, rope_scaling=rope, rope_theta=10000.0),
                          bos_token_id=0, eos_token_id=1)
    model.train()
    torch.manual_seed(0)
    with torch.no_grad():  # a normal init to train from (make_hf_model's is deliberately extreme)
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _data(folder, seed=7)
    batches = [next(data) for _ in range(8)]  # cycled: the model's steps, not data making, take the time
    for i in range(60):  # loss 5.8 -> about 0.4: far from any random init, cheap on 2 shared cores
        loss = _hf_loss(model, batches[i % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(folder)
    with torch.no_grad():
        first = _hf_loss(model, next(_data(folder, seed=42))).item()
    return folder, model, first


@pytest.mark.slow
def test_continue_training_export_round_trip(trained, tmp_path):
    folder, hf_model, hf_first_loss = trained
    assert hf_first_loss < 1.0  # trained: a random init is at ln(320) = 5.8
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--model.hf_assets_path", folder, "--model.tokenizer", "hf",  # its weights by default
           "--job.dump_folder", str(run), "--parallelism.ulysses_degree", "2", "--training.dataset", "passkey",
           "--training.passkey_digits", "1", "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
           "--training.steps", "2", "--training.seed", "42", "--training.mixed_precision_param", "float32",
           "--optimizer.lr", "1e-7", "--optimizer.weight_decay", "0", "--lr_scheduler.warmup_steps", "0",
           "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LlamaForCausalLM 2 layers, dim 64" in proc.stdout and f"weights from the Hugging Face folder {folder}" in (
        proc.stdout)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(losses[0] - hf_first_loss) <= 1e-5 * hf_first_loss, (losses, hf_first_loss)

    # rerunning resumes from the run's own checkpoint, not from the folder
    proc = subprocess.run([*cmd[:-6], "--training.steps", "3", *cmd[-4:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights from step-2 of this run" in proc.stdout and "starting at step 2" in proc.stdout
    assert "attention sdpa (PyTorch's kernel order)" in proc.stdout  # "auto" on a machine without a GPU

    step = run / "checkpoint" / "step-2"
    assert (step / "model_args.json").exists() and (step / "hf_assets" / "tokenizer.json").exists()
    # the record says what the model is, not how this run computed it
    recorded = json.loads((step / "model_args.json").read_text())["args"]
    assert not {"attn_backend", "sdpa_backends", "mlp_tile_size", "loss_backend", "loss_chunk_size"} & set(recorded), sorted(recorded)
    out = tmp_path / "export"
    # no --dtype: the folder's float32 comes back (bfloat16 would move each weight by up to 4e-3)
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", "--checkpoint", str(step), "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(float32, the dtype of the source weights)" in proc.stdout, proc.stdout
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(exported).__name__ == "LlamaForCausalLM"
    ours, theirs = exported.state_dict(), hf_model.state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():  # Adam moves each weight by about lr per step: 2e-7
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["factor"] == 2.0 and config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 0  # carried over from the source config.json
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok(TEXTS[1], add_special_tokens=False).input_ids == HFTokenizer(folder).encode(TEXTS[1], False, False)


def test_export_shards_with_an_index_above_the_threshold(trained, tmp_path):
    """A checkpoint written by the trainer exports as several safetensors + index when over max_shard_size."""
    import torch.distributed.checkpoint as dcp

    from titan_ulysses.interop.hf_weights import export_hf, load_hf_weights
    from titan_ulysses.interop.hf_export import write_model_record
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.interop.hf_config import load_hf_args

    folder, hf_model, _ = trained
    model = Transformer(load_hf_args(folder))
    load_hf_weights(model, folder)
    step = tmp_path / "step-1"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_model_record(str(step), model.args, folder)
    add_manifest(step)
    written = export_hf(str(step), None, str(tmp_path / "out"), torch.float32, max_shard_size=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) < set(written) and "tokenizer_config.json" in written
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    for name, value in hf_model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_tokenizer_ids_equal_autotokenizer(tmp_path):
    make_tokenizer(str(tmp_path / "llama"))
    text = "Zürich  naïve\t\t東京 🙂 12345 678\n\n  def f(x):  return 3.14159   — end"
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "llama"))
    ours = HFTokenizer(str(tmp_path / "llama"))
    ids = auto(text, add_special_tokens=False).input_ids
    assert ours.encode(text, bos=False, eos=False) == ids and len(ids) > 20
    assert ours.encode(text) == [auto.bos_token_id] + ids + [auto.eos_token_id]
    assert ours.decode(ours.encode(text)) == auto.decode(ids) and ours.vocab_size == len(auto)
    assert ours.pad_id == ours.eos_id  # no pad token: EOS
    # a family without BOS (Qwen): documents start with EOS; ids still those of transformers
    make_tokenizer(str(tmp_path / "qwen"), bos=False)
    qwen = HFTokenizer(str(tmp_path / "qwen"))
    assert not qwen.has_bos and qwen.encode("a", eos=False)[0] == qwen.eos_id


def test_help_lists_sections_keys_defaults_and_docstrings(capsys):
    sys.path.insert(0, ROOT)
    import train

    assert train.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "[model]" in out and "[checkpoint]" in out and "--training.seq_len 2048" in out
    assert "--model.hf_assets_path ''" in out and "huggingface-cli download" in out
    assert "--checkpoint.initial_load_in_hf None" in out and "(one of '', byte, tiktoken, hf)" in out


@pytest.fixture
def refusal(capsys, monkeypatch):
    """``train.main(argv)`` must exit 2 with one line on stderr, without reading any weight; returns the line."""
    import torch.distributed.checkpoint as dcp

    sys.path.insert(0, ROOT)
    import train

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read before the configuration was refused")

    monkeypatch.setattr(dcp, "load", no_weights)
    monkeypatch.setattr("titan_ulysses.interop.hf_weights.load_hf_weights", no_weights)

    def run(argv):
        with pytest.raises(ConfigError):  # the same error from the checks alone, as estimate_memory / tests use them
            config = load_config(argv)
            validate(config, 1)
            check_files(config)
        capsys.readouterr()
        assert train.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("config error: "), err
        return err[0][len("config error: "):]

    return run


def test_refusals_name_the_setting_before_any_weight_is_read(trained, tmp_path, refusal):
    import torch.distributed.checkpoint as dcp

    from model_harness import small_args
    from titan_ulysses.models.decoder.model import Transformer

    folder = trained[0]
    hf = ["--model.hf_assets_path"]
    sw = str(tmp_path / "sw")
    make_hf_model(sw, "qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0))
    assert "model.hf_assets_path: use_sliding_window true (sliding_window 16)" in refusal(hf + [sw])
    for name, cfg, message in [
        ("moe", {"model_type": "deepseek_v3", "n_routed_experts": 8}, "model_type 'deepseek_v3' is a mixture-of-experts model"),
        ("unknown", {"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported (one of ["),
        ("hybrid", {"layer_types": ["linear_attention", "full_attention"]},
         "layer_types contains 'linear_attention': state-space / linear-attention layers are not supported"),
        # the Hub's spelling (transformers < 5): rope_theta + rope_scaling
        ("dynamic", {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
         "rope_scaling.rope_type 'dynamic' is not supported"),
    ]:
        os.makedirs(tmp_path / name)
        base = json.loads(open(os.path.join(folder, "config.json")).read())
        (tmp_path / name / "config.json").write_text(json.dumps({k: v for k, v in {**base, **cfg}.items()
                                                                 if v is not None}))
        assert message in refusal(hf + [str(tmp_path / name)]), name
    assert f"model.hf_assets_path: '{tmp_path}' has no config.json" in refusal(hf + [str(tmp_path)])
    plain = str(tmp_path / "plain")  # a model folder without tokenizer.json
    make_hf_model(plain, "qwen3", {})
    assert refusal(hf + [plain, "--model.tokenizer", "hf"]) == (
        f"model.hf_assets_path: no tokenizer.json at '{plain}/tokenizer.json'")
    # config.json and the weights disagree (a shape changed by hand): refused from the headers alone
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), bad / f)
    os.unlink(bad / "config.json")
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert "'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] in the safetensors files but [96, 64]" in (
        refusal(hf + [str(bad), "--checkpoint.initial_load_in_hf", "true"]))
    # a checkpoint of one shape as the start of a run of another
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": Transformer(small_args()).state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    add_manifest(ckpt)  # a committed checkpoint (verified first), of another shape
    msg = refusal(["--model.flavor", "debugmodel", "--checkpoint.initial_load_path", str(ckpt)])
    assert msg.startswith("checkpoint.initial_load_path: the checkpoint does not match the model arguments")


@pytest.mark.slow
def test_missing_tokenizer_is_one_line_once_exit_2(trained, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           "--model.hf_assets_path", trained[0], "--model.tokenizer", "hf", "--model.tokenizer_path", str(tmp_path),
           "--parallelism.ulysses_degree", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    refusal = f"config error: model.tokenizer_path: no tokenizer.json at '{tmp_path}/tokenizer.json'"
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    # printed once by rank 0, and repeated as the last line of torchrun's report (its "traceback :" field)
    assert lines == [refusal, f"  traceback : {refusal}"], proc.stderr[-2000:]
    # no traceback from our code (torchrun prints its own ChildFailedError); the worker exited with 2
    assert "titan_ulysses/" not in proc.stderr and 'train.py", line' not in proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
