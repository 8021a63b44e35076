"""A sharded checkpoint exported to Hugging Face format gives transformers' Llama the same logits."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from model_harness import build_pair, small_args
from titan_ulysses.checkpoint.hf import export_hf
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.models.llama.args import RopeScaling, get_flavor
from titan_ulysses.models.llama.model import Transformer
from titan_ulysses.models.llama.parallelize import ParallelizeOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    # RoPE scaling with a short original context so it matters at 24 tokens
    "rope-scaled": dict(rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16)),
    "tied": dict(tie_embeddings=True, rope_theta=500000.0),
}


def _save_sharded(folder, overrides, flavor=None):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = get_flavor(flavor) if flavor else small_args(**overrides)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32))
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
    export_hf(str(tmp_path / "step-1"), args, str(tmp_path / "hf"), dtype=torch.float32)

    ours = Transformer(args)
    ours.load_state_dict(torch.load(tmp_path / "reference.pt"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        actual = hf(tokens).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_export_script(tmp_path):
    run_distributed(_save_sharded, 2, str(tmp_path / "ckpt"), {}, "debugmodel")

    def export(flavor, out):
        return subprocess.run(
            [sys.executable, "scripts/export_hf.py", "--checkpoint", str(tmp_path / "ckpt" / "step-1"),
             "--flavor", flavor, "--output", str(tmp_path / out), "--dtype", "float32"],
            cwd=ROOT, capture_output=True, text=True)

    proc = export("debugmodel", "hf")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["num_key_value_heads"] == 4 and config["vocab_size"] == 264
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert len(tensors) == 2 + 1 + 6 * 9 and tensors["lm_head.weight"].shape == (264, 256)
    # a flavor that does not match the checkpoint is refused, and nothing is written
    proc = export("debugmodel_gqa1", "hf_wrong")
    assert proc.returncode != 0 and "does not match the model arguments" in proc.stderr
    assert not (tmp_path / "hf_wrong" / "model.safetensors").exists()
