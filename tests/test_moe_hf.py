"""Hugging Face folders of the mixture-of-experts families in and out: the loader reads each rank's
experts only (sharded over ep), and export writes a folder AutoModelForCausalLM loads with the
source's tensors bit for bit and its logits."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_utils import assert_close, run_distributed
from helpers import add_manifest
from model_harness import clean_name, full
from test_moe_families import MOE_VARIANTS, as_saved, hf_moe
from titan_ulysses.interop.hf_weights import load_hf_weights
from titan_ulysses.interop.hf_adapter import from_hf
from titan_ulysses.interop.hf_export import export_hf, write_model_record
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
from titan_ulysses.interop.hf_config import load_hf_args
from titan_ulysses.models.registry import build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in MOE_VARIANTS:
        folder = str(tmp_path_factory.mktemp(name))
        hf = hf_moe(name)
        hf.save_pretrained(folder, max_shard_size="60KB")  # experts spread over several files
        out[name] = folder
    return out


def _loads_own_experts(folder, name):
    pd = ParallelDims(dp_shard=2, ep=2, world_size=2)
    pd.build_mesh("cpu")
    args = load_hf_args(folder)
    with torch.device("meta"):
        model = build_model(args, ComputeOptions(attn_backend="sdpa"))
    parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=torch.float32))
    model.to_empty(device="cpu")
    model.init_buffers()
    requested = []
    original = dcp.load
    dcp.load = lambda state, **kw: (requested.extend(state), original(state, **kw))[1]
    try:
        load_hf_weights(model, folder)
    finally:
        dcp.load = original
    want = from_hf(as_saved(hf_moe(name), hf_moe(name).state_dict()), args)
    for n, p in model.named_parameters():
        assert_close(full(p.detach()), want[clean_name(n)], f"{name}: {n}")
    per_expert = [k for k in requested if ".experts." in k and k.split(".experts.")[1][0].isdigit()]
    if per_expert:  # this rank asked for its own experts' tensors and no other's
        e = args.moe.num_experts
        mine = range(dist.get_rank() * e // 2, (dist.get_rank() + 1) * e // 2)
        assert {int(k.split(".experts.")[1].split(".")[0]) for k in per_expert} == set(mine)


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_each_rank_loads_only_its_experts(folders, name):
    run_distributed(_loads_own_experts, 2, folders[name], name)


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_export_round_trip(folders, name, tmp_path):
    from safetensors.torch import load_file

    folder = folders[name]
    args = load_hf_args(folder)
    model = build_model(args, ComputeOptions(attn_backend="sdpa"))
    load_hf_weights(model, folder)
    step = str(tmp_path / "step-1")
    dcp.save({"model": model.state_dict()}, checkpoint_id=step, no_dist=True)
    write_model_record(step, args, folder, seq_len=32)
    add_manifest(step)
    out = str(tmp_path / "out")
    export_hf(step, None, out, torch.float32, max_shard_size=60 * 1024)

    def tensors(d):
        return {k: v for f in os.listdir(d) if f.endswith(".safetensors") for k, v in load_file(os.path.join(d, f)).items()}

    source, exported = tensors(folder), tensors(out)
    assert set(exported) == set(source)
    for key, w in source.items():
        assert torch.equal(exported[key], w), key
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs.config._attn_implementation = "eager"
    tokens = torch.randint(0, args.vocab_size, (1, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(theirs(tokens).logits, model(tokens), f"{name}: exported logits")
