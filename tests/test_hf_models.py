"""Hugging Face folders load sharded (sp=2, dp_shard=2 x sp=2) with the logits and loss of transformers' own forward.

Llama 3 (untied with llama3 RoPE scaling; tied, sharded with an index), Qwen3 (q/k norm,
head_dim != dim / heads, tied, sharded) and Qwen2 (q/k/v biases), all GQA, fp32. Weights
are random but far from the init (sharp attention, non-unit norms, large biases) so that
a missed permutation of a q/k weight, bias or norm, or a wrong RoPE setting, moves the
logits by far more than the tolerance.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import assert_close, run_distributed
from hf_fixtures import VARIANTS, make_hf_model
from helpers import add_manifest
from model_harness import make_batch, parallel_from_hf, parallel_step
from titan_ulysses.interop.hf_weights import load_hf_weights
from titan_ulysses.interop.hf_adapter import from_hf, halves_to_interleaved, interleaved_to_halves, to_hf
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.interop.hf_config import load_hf_args

pytest.importorskip("transformers")
SEQ, BATCH = 24, 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per variant, with transformers' logits and loss on a fixed batch beside it."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (model_type, overrides, shard) in VARIANTS.items():
        folder = str(root / name)
        hf = make_hf_model(folder, model_type, overrides, shard)
        inputs, labels = make_batch(0, BATCH, SEQ, hf.config.vocab_size)
        with torch.no_grad():
            logits = hf(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        torch.save({"inputs": inputs, "labels": labels, "logits": logits, "loss": loss},
                   os.path.join(root, f"{name}.ref.pt"))
        out[name] = folder
    return out


def test_folders_are_single_file_and_sharded(folders):
    files = {name: sorted(os.listdir(folder)) for name, folder in folders.items()}
    assert "model.safetensors" in files["llama-untied-llama3rope"] and "model.safetensors" in files["qwen2-bias"]
    for name in ("llama-tied-sharded", "qwen3-tied-headdim"):
        assert "model.safetensors.index.json" in files[name] and "model.safetensors" not in files[name]
        assert sum(f.endswith(".safetensors") for f in files[name]) >= 3


def _load_and_compare(folders: dict, dp_shard: int, sp: int) -> None:
    pd = ParallelDims(dp_shard=dp_shard, sp=sp, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
    sp_rank = pd.get_mesh("sp").get_local_rank()
    for name, folder in folders.items():
        model = parallel_from_hf(folder, pd, ParallelizeOptions(param_dtype=torch.float32))
        ref = torch.load(os.path.join(os.path.dirname(folder), f"{name}.ref.pt"))
        loss, logits = parallel_step(model, pd, ref["inputs"], ref["labels"])
        expected = ref["logits"].chunk(dp)[dp_rank].chunk(sp, dim=1)[sp_rank]
        assert_close(logits[0], expected, f"{name} logits (dp_shard {dp_shard}, sp {sp})")
        assert_close(loss.float(), ref["loss"], f"{name} loss (dp_shard {dp_shard}, sp {sp})")


@pytest.mark.parametrize("dp_shard, sp", [(1, 2), (2, 2)])
def test_sharded_load_matches_transformers(folders, dp_shard, sp):
    run_distributed(_load_and_compare, dp_shard * sp, folders, dp_shard, sp)


def test_adapter_round_trips_and_permutes_biases_and_norms(folders):
    from safetensors.torch import load_file

    for name in ("qwen2-bias", "qwen3-tied-headdim"):
        folder = folders[name]
        args = load_hf_args(folder)
        files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        hf_state = {k: v for f in files for k, v in load_file(os.path.join(folder, f)).items()}
        ours = from_hf(hf_state, args)
        assert set(to_hf(ours, args)) == set(hf_state)  # tied: no lm_head either way
        for k, v in to_hf(ours, args).items():
            assert torch.equal(v, hf_state[k]), k
        # the RoPE-ordered 1-D tensors really move: pairs (2i, 2i+1) come from (i, i + Dh/2)
        key = ("layers.0.attention.wq.bias" if args.qkv_bias else "layers.0.attention.q_norm.weight")
        theirs = hf_state["model." + key.replace("attention.wq.bias", "self_attn.q_proj.bias")
                          .replace("attention.q_norm.weight", "self_attn.q_norm.weight")]
        half = args.head_dim // 2
        assert torch.equal(ours[key][1], theirs[half]) and torch.equal(ours[key][2], theirs[1])
    w = torch.randn(4 * 16, 8)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, 4), 4), w)


def test_single_process_load_without_fsdp(folders, capsys):
    """Plain tensors (no process group, no DTensor) take the same path; a progress bar counts the tensors."""
    import re

    folder = folders["qwen3-tied-headdim"]
    ref = torch.load(os.path.join(os.path.dirname(folder), "qwen3-tied-headdim.ref.pt"))
    assert load_hf_args(folder).rope_theta == 2500.0  # the fixture's non-default base
    model = Transformer(load_hf_args(folder))
    capsys.readouterr()
    load_hf_weights(model, folder)
    assert re.search(r"loading .*qwen3-tied-headdim: 100%.* (\d+)/\1 ", capsys.readouterr().err)
    with torch.no_grad():
        assert_close(model(ref["inputs"]), ref["logits"], "qwen3 logits, one process")


def test_qwen3_head_dim_defaults_to_128_without_head_dim_in_config_json(tmp_path):
    """transformers' Qwen3Config defaults head_dim to 128, not hidden_size / heads (64 / 8 = 8 here)."""
    import json

    import transformers

    from hf_fixtures import BASE

    cfg = transformers.Qwen3Config(**BASE).to_dict()
    del cfg["head_dim"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    assert load_hf_args(str(tmp_path)).head_dim == transformers.Qwen3Config(**cfg).head_dim == 128


@pytest.mark.parametrize("name", ["qwen3-tied-headdim", "qwen2-bias"])
def test_export_of_each_family_loads_in_transformers(folders, name, tmp_path):
    """HF folder -> our model -> DCP checkpoint with its record -> export -> transformers: the same logits."""
    import torch.distributed.checkpoint as dcp
    import transformers

    from titan_ulysses.interop.hf_export import export_hf, write_model_record

    folder = folders[name]
    model = Transformer(load_hf_args(folder))
    load_hf_weights(model, folder)
    step = str(tmp_path / "step-1")
    dcp.save({"model": model.state_dict()}, checkpoint_id=step, no_dist=True)
    write_model_record(step, model.args, folder)
    add_manifest(step)
    export_hf(step, None, str(tmp_path / "out"), torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[name[:5]]
    ref = torch.load(os.path.join(os.path.dirname(folder), f"{name}.ref.pt"))
    with torch.no_grad():
        assert_close(hf(ref["inputs"]).logits, ref["logits"], f"{name} exported logits")
