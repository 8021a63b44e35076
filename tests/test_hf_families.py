"""Every family beyond Llama / Qwen equals transformers' own forward: logits, loss and every gradient.

Mistral (Nemo's head_dim, a window shorter than the sequence), Phi-3 (fused qkv / gate_up,
longrope past the original context), Phi-4-mini (partial rotary, tied, sharded files),
Gemma 3 (local and global layers, its DecoderSpec), GLM-4 (half-rotary interleaved RoPE, q/k/v
biases, fused gate_up) and Qwen3 with YaRN, loaded from single-file and sharded folders at sp=2
(inside dp_replicate=2), dp_shard=2 x sp=2 and cp=2 x sp=2, all in one 4-rank launch. Weights are random but far from
the init (tests/hf_fixtures.py) so that a wrong permutation, split or RoPE setting moves the
logits far beyond the tolerance.

Windows (Mistral, Gemma's local layers) and Gemma 2's softcap run on the sdpa backend itself
(ops/attention/), under Ulysses and under cp at the global positions of its chunks.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import assert_close, run_distributed
from hf_fixtures import FAMILY_VARIANTS, make_hf_model
from helpers import add_manifest
from model_harness import clean_name, full, make_batch
from titan_ulysses.interop.hf_weights import load_hf_weights
from titan_ulysses.interop.hf_adapter import to_hf
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.interop.hf_config import load_hf_args
from titan_ulysses.models.registry import build_model, get_family, parallelize_model
from titan_ulysses.ops.loss import cross_entropy_sum

pytest.importorskip("transformers")
SEQ, BATCH = 24, 4
LAYOUTS = [dict(dp_replicate=2, sp=2), dict(dp_shard=2, sp=2), dict(cp=2, sp=2)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One folder per variant; transformers' logits, loss and gradients on a fixed batch beside it."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (model_type, overrides, shard) in FAMILY_VARIANTS.items():
        folder = str(root / name)
        hf = make_hf_model(folder, model_type, overrides, shard)
        inputs, labels = make_batch(0, BATCH, SEQ, hf.config.vocab_size)
        inputs[:, 5] = 0  # pad_token_id 0 where the config has one: its embedding row gets no gradient
        logits = hf(inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        grads = {n: p.grad for n, p in hf.named_parameters()}
        torch.save({"inputs": inputs, "labels": labels, "logits": logits.detach(), "loss": loss.detach(),
                    "grads": grads}, os.path.join(root, f"{name}.ref.pt"))
        out[name] = folder
    return out


def _step(model, pd, inputs, labels):
    """This rank's share (dp, then cp x sp): (global mean loss, logits, token index of the logits)."""
    dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
    sp, cp = pd.get_mesh("sp"), pd.get_mesh("cp")
    mb = shard_batch(inputs.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], sp.get_local_rank(), sp.size(),
                     cp_rank=cp.get_local_rank(), cp=cp.size())
    n_tokens = dist_sum((mb.labels != -100).sum().float(), pd.get_mesh("loss"))
    logits = model(mb.tokens, positions=mb.positions)
    loss = cross_entropy_sum(logits, mb.labels) / n_tokens
    loss.backward()
    return dist_sum(loss.detach(), pd.get_mesh("loss")), logits.detach(), mb.index


def _families_match(folders: dict) -> None:
    for layout in LAYOUTS:
        pd = ParallelDims(**layout, world_size=dist.get_world_size())
        pd.build_mesh("cpu")
        dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
        for name, folder in folders.items():
            args = load_hf_args(folder)
            what = f"{name} {layout}"
            with torch.device("meta"):
                model = build_model(args)
            parallelize_model(model, pd, ParallelizeOptions(param_dtype=torch.float32))
            model.to_empty(device="cpu")
            model.init_buffers()
            model.rope_seq_len = SEQ  # as the trainer sets it: longrope picks its factors by the full length
            with torch.no_grad():  # garbage that the load must overwrite everywhere
                for p in model.parameters():
                    p.fill_(float("nan"))
            load_hf_weights(model, folder)
            ref = torch.load(os.path.join(os.path.dirname(folder), f"{name}.ref.pt"))
            loss, logits, index = _step(model, pd, ref["inputs"], ref["labels"])
            assert_close(logits, ref["logits"].chunk(dp)[dp_rank][:, index], f"{what} logits")
            assert_close(loss.float(), ref["loss"], f"{what} loss")
            grads = to_hf({clean_name(n): full(p.grad) for n, p in model.named_parameters()}, args)
            assert set(grads) == set(ref["grads"]), what
            for key, g in grads.items():
                assert_close(g, ref["grads"][key], f"{what} grad {key}", rtol=1e-4, atol=1e-5)


def test_families_match_transformers_in_every_layout(folders):
    run_distributed(_families_match, 4, folders)


class _Records(__import__("logging").Handler):
    def __init__(self):
        super().__init__(level=30)  # WARNING and above
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("name", list(FAMILY_VARIANTS))
def test_export_round_trip_is_exact_and_loads_silently(folders, name, tmp_path):
    """HF folder -> our model -> DCP checkpoint with its record -> export: the same tensors bit for bit,
    AutoModelForCausalLM builds the family's class without a warning, and its logits are the source's."""
    import logging
    import warnings

    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import load_file

    from titan_ulysses.interop.hf_export import export_hf, write_model_record

    folder = folders[name]
    model = build_model(load_hf_args(folder))
    load_hf_weights(model, folder)
    step = str(tmp_path / "step-1")
    dcp.save({"model": model.state_dict()}, checkpoint_id=step, no_dist=True)
    write_model_record(step, model.args, folder, seq_len=SEQ)
    add_manifest(step)
    out = str(tmp_path / "out")
    export_hf(step, None, out, torch.float32, max_shard_size=40 * 1024)

    def tensors(d):
        return {k: v for f in os.listdir(d) if f.endswith(".safetensors") for k, v in load_file(os.path.join(d, f)).items()}

    source, exported = tensors(folder), tensors(out)
    assert set(exported) == set(source), name
    for key, w in source.items():
        assert torch.equal(exported[key], w), f"{name} {key}"
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not records.messages and not [str(w.message) for w in caught], (records.messages, caught)
    assert type(hf).__name__ == get_family(model.args.family).architecture, name
    hf.config._attn_implementation = "eager"
    ref = torch.load(os.path.join(os.path.dirname(folder), f"{name}.ref.pt"))
    with torch.no_grad():
        assert_close(hf(ref["inputs"]).logits, ref["logits"], f"{name} exported logits")
