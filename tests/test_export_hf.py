"""A sharded checkpoint exported to Hugging Face format gives transformers' Llama the same logits.

transformers is a dev dependency; without it the logits tests skip, and the RoPE permutation
is still checked against an independent rotate_half implementation below.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from model_harness import build_pair, small_args
from titan_ulysses.interop.hf_weights import export_hf, interleaved_to_halves
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import load_full_state_dict
from titan_ulysses.models.decoder.args import RopeScaling
from titan_ulysses.models.decoder.attention import apply_rope
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.models.flavors import get_flavor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    # RoPE scaling with a short original context so it matters at 24 tokens
    "rope-scaled": {"rope_scaling": RopeScaling(factor=4.0, original_max_position_embeddings=16)},
    "tied": {"tie_embeddings": True, "rope_theta": 500000.0},
}


def _save_sharded(folder, overrides, flavor=None):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = get_flavor(flavor) if flavor else small_args(**overrides)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32))
    with torch.no_grad():  # sharp attention, so that RoPE mistakes (order, scaling) show in the logits
        for layer in ref.layers.values():
            layer.attention.wq.weight.mul_(10)
            layer.attention.wk.weight.mul_(10)
    load_full_state_dict(model, ref.state_dict())
    opt = torch.optim.AdamW(model.parameters())
    CheckpointManager(folder=folder, model=model, optimizer=opt, lr_scheduler=opt, dataloader=opt,
                      enable=True, interval=1).save(1)
    if dist.get_rank() == 0:
        torch.save(ref.state_dict(), os.path.join(folder, "reference.pt"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exported_model_matches_in_transformers(tmp_path, variant):
    transformers = pytest.importorskip("transformers")  # a dev dependency: installed in CI
    overrides = VARIANTS[variant]
    run_distributed(_save_sharded, 2, str(tmp_path), overrides)
    args = small_args(**overrides)
    export_hf(str(tmp_path / "step-1"), args, str(tmp_path / "hf"))  # float32: the dtype saved

    ours = Transformer(args)
    ours.load_state_dict(torch.load(tmp_path / "reference.pt"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        actual = hf(tokens).logits
    # without the permutation, or without rope_scaling in config.json, logits differ by > 0.05
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert len(names) == 2 + args.n_layers * 9 + (0 if args.tie_embeddings else 1)
    if variant == "tied":
        assert config["tie_word_embeddings"] is True and "lm_head.weight" not in names
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        assert "rope_scaling" not in config and config["rope_theta"] == 500000.0
    else:
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in names
        assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def test_permutation_turns_interleaved_rope_into_rotate_half():
    """Independent of transformers: HF's convention on the permuted weights gives our rotated q, k
    with each head's features reordered (even ones first), hence the same attention scores."""
    torch.manual_seed(0)
    n_heads, head_dim, dim, seq = 4, 16, 32, 11
    args = small_args(dim=n_heads * head_dim, n_heads=n_heads, n_kv_heads=n_heads,
                      rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16))
    model = Transformer(args)
    cos, sin = model.rope(torch.arange(seq))  # [1, S, 1, Dh/2]
    w = torch.randn(n_heads * head_dim, dim)
    x = torch.randn(1, seq, dim)

    ours = apply_rope((x @ w.T).view(1, seq, n_heads, head_dim), cos, sin)
    q = (x @ interleaved_to_halves(w, n_heads).T).view(1, seq, n_heads, head_dim)
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # HF: emb = cat(freqs, freqs)
    theirs = q * cos2 + _rotate_half(q) * sin2

    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    torch.testing.assert_close(theirs, ours[..., perm], rtol=1e-5, atol=1e-5)
    scores = torch.einsum("bshd,bthd->bhst", ours, ours)
    torch.testing.assert_close(torch.einsum("bshd,bthd->bhst", theirs, theirs), scores, rtol=1e-5, atol=1e-4)
    # without the permutation the conventions disagree
    q_plain = (x @ w.T).view(1, seq, n_heads, head_dim)
    assert not torch.allclose(q_plain * cos2 + _rotate_half(q_plain) * sin2, ours[..., perm], atol=1e-2)


def test_export_script(tmp_path, capsys):
    """The script's main() in this process (the command line itself runs in test_hf_train and the guide)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_hf_script", os.path.join(ROOT, "scripts", "export_hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    run_distributed(_save_sharded, 2, str(tmp_path / "ckpt"), {}, "debugmodel")

    def export(flavor, out, *more):
        code = script.main(["--checkpoint", str(tmp_path / "ckpt" / "step-1"), "--flavor", flavor,
                            "--output", str(tmp_path / out), *more])
        return code, capsys.readouterr().err

    from safetensors.torch import load_file

    # a run from scratch exports the dtype of its saved parameters (float32) unless --dtype says otherwise
    code, err = export("debugmodel", "hf_fp32")
    assert code == 0, err
    assert json.loads((tmp_path / "hf_fp32" / "config.json").read_text())["dtype"] == "float32"
    reference = torch.load(tmp_path / "ckpt" / "reference.pt")
    exported = load_file(str(tmp_path / "hf_fp32" / "model.safetensors"))
    assert torch.equal(exported["model.embed_tokens.weight"], reference["tok_embeddings.weight"])
    code, err = export("debugmodel", "hf", "--dtype", "bfloat16")
    assert code == 0, err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["num_key_value_heads"] == 4 and config["vocab_size"] == 264
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "bfloat16"
    assert config["hidden_size"] == 256 and config["intermediate_size"] == 768 and config["num_attention_heads"] == 16
    assert config["rope_theta"] == 10000.0 and "rope_scaling" not in config and config["tie_word_embeddings"] is False
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert len(tensors) == 2 + 1 + 6 * 9 and tensors["lm_head.weight"].shape == (264, 256)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["model.layers.5.self_attn.k_proj.weight"].shape == (4 * 16, 256)
    # a flavor that does not match the checkpoint is refused, and nothing is written
    code, err = export("debugmodel_gqa1", "hf_wrong")
    assert code != 0 and "does not match the model arguments" in err
    assert not (tmp_path / "hf_wrong" / "model.safetensors").exists()

    # issue 38: an output folder holding anything is refused unless --overwrite, then replaced whole (issue 43:
    # only a previous export; tests/test_export_safety.py has the rest)
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    code, err = export("debugmodel", "hf")
    assert code == 2 and f"--output '{tmp_path / 'hf'}' holds a previous export (" in err and "pass --overwrite" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    code, err = export("debugmodel_gqa1", "hf", "--overwrite")  # fails after the check: the old folder stays
    assert code == 2 and {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):  # another model's shards
        (tmp_path / "hf" / name).write_text("old")
    code, err = export("debugmodel", "hf", "--overwrite")
    assert code == 0 and sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(before), err
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    inside = tmp_path / "ckpt" / "step-1" / "hf_assets"  # never into a checkpoint, --overwrite or not
    files = sorted(p.name for p in (tmp_path / "ckpt" / "step-1").rglob("*"))
    code, err = export("debugmodel", inside.relative_to(tmp_path), "--overwrite")
    assert code == 2 and f"lies inside the checkpoint {tmp_path / 'ckpt' / 'step-1'}" in err, err
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-1").rglob("*")) == files
    code = script.main(["--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and f"'{tmp_path / 'nowhere'}' does not exist" in err and "model_args" not in err, err


def test_export_takes_the_dtype_of_the_source_weights_not_config_json(tmp_path, capsys):
    """Issue 33, item 4: config.json said bfloat16 over F32 safetensors, and the export downcast to
    BF16 saying "the dtype the weights came in". The dtype now comes from the tensors (recorded in
    the checkpoint); config.json's disagreement is named in the output line."""
    pytest.importorskip("transformers")
    import importlib.util

    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from helpers import add_manifest
    from hf_fixtures import make_hf_model
    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.interop.hf_export import write_model_record
    from titan_ulysses.interop.hf_config import load_hf_args

    spec = importlib.util.spec_from_file_location("export_hf_script", os.path.join(ROOT, "scripts", "export_hf.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def source(name, dtype):
        folder = tmp_path / name
        make_hf_model(str(folder), "llama", {})
        file = str(folder / "model.safetensors")
        save_file({k: v.to(dtype) for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
        return str(folder)

    def checkpoint(folder, name):
        args = load_hf_args(folder)
        model = Transformer(args)
        load_hf_weights(model, folder)
        step = tmp_path / name / "step-1"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
        write_model_record(str(step), args, folder)
        add_manifest(step)
        return step

    def export(step, out):
        assert script.main(["--checkpoint", str(step), "--output", str(tmp_path / out)]) == 0
        line = capsys.readouterr().out.strip()
        with safe_open(str(tmp_path / out / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
        assert json.loads((tmp_path / out / "config.json").read_text())["dtype"] == {"F32": "float32",
                                                                                     "BF16": "bfloat16"}[dtypes.pop()]
        assert not dtypes
        return line.split(": model.safetensors")[0]

    f32 = checkpoint(source("f32", torch.float32), "run_f32")
    assert export(f32, "out_f32") == (f"wrote {tmp_path / 'out_f32'} (float32, the dtype of the source weights; the "
                                      f"source config.json says bfloat16 (--dtype writes another))")
    assert json.loads((f32 / "model_args.json").read_text())["weights_dtype"] == "float32"
    bf16 = checkpoint(source("bf16", torch.bfloat16), "run_bf16")
    assert export(bf16, "out_bf16") == f"wrote {tmp_path / 'out_bf16'} (bfloat16, the dtype of the source weights)"
    # a checkpoint recorded before weights_dtype existed: the saved parameters' dtype, never config.json's claim
    record = json.loads((f32 / "model_args.json").read_text())
    del record["weights_dtype"]
    (f32 / "model_args.json").write_text(json.dumps(record))
    os.remove(f32 / "manifest.json")
    add_manifest(f32)
    assert export(f32, "out_old") == (
        f"wrote {tmp_path / 'out_old'} (float32, the dtype of the saved parameters (the checkpoint does not record "
        f"its source weights' dtype); the source config.json says bfloat16 (--dtype writes another))")
