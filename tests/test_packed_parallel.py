"""A packed SFT batch (several samples per row, positions restarting per sample, rows that
differ) gives the same loss and gradients at sp=2 and dp_shard=2 x sp=2 as one process,
and the same loss as running every sample on its own: document masking (sdpa's dense mask)
and per-document positions are right under Ulysses.

The packed path through the trainer itself (gradient accumulation over microbatches of
unequal token counts, validation, evaluate-then-save) is in ``test_trainer_data.py``.
"""

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import build_pair, clean_name, full, small_args
from titan_ulysses.config.manager import load_config
from titan_ulysses.data.build import build_dataset
from titan_ulysses.data.sharding import shard_loader_batch
from titan_ulysses.data.tokenizer import ByteTokenizer
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.step import global_token_count
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.ops.attention import build_attention_mask
from titan_ulysses.ops.loss import IGNORE_INDEX

SEQ_LEN = 63  # odd: sp padding on top of packing padding


def write_sft(path, n=40, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(list("abcdefgh"), int(rng.integers(2, 20))))
            completion = "".join(rng.choice(list("xyz "), int(rng.integers(1, 12))))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def packed_batch(path, rows=4):
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", path,
                          "--training.seq_len", str(SEQ_LEN)])
    ds = build_dataset("sft", path, ByteTokenizer(), config, 0)
    items = [ds[i] for i in range(rows)]
    return {k: torch.stack([it[k] for it in items]) for k in ("input", "labels", "document_ids", "positions")}


def _compare(path, layout):
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    # trained-like weights: a document-mask leak moves the loss far above the tolerance (at init: 7e-6)
    ref, model = build_pair(small_args(), pd, ParallelizeOptions(param_dtype=torch.float32), trained=True)
    batch = packed_batch(path)
    assert not all(torch.equal(batch["positions"][0], row) for row in batch["positions"][1:])
    n_tokens = (batch["labels"] != IGNORE_INDEX).sum()

    mask = build_attention_mask("sdpa", batch["document_ids"])
    ref_loss = ref(batch["input"], positions=batch["positions"], attention_mask=mask, labels=batch["labels"]) / n_tokens
    ref_loss.backward()

    with torch.no_grad():  # every sample on its own, causal, positions from 0
        alone = torch.zeros(())
        for r in range(batch["input"].shape[0]):
            docs = batch["document_ids"][r]
            for d in docs.unique():
                if d < 0:
                    continue
                cols = (docs == d).nonzero().flatten()
                alone += ref(batch["input"][r, cols][None], labels=batch["labels"][r, cols][None])
    assert_close(alone / n_tokens, ref_loss.detach(), "packed loss vs each sample alone")

    dp_mesh, sp_mesh = pd.get_mesh("dp"), pd.get_mesh("sp")
    local = {k: v.chunk(dp_mesh.size())[dp_mesh.get_local_rank()] for k, v in batch.items()}
    mb = shard_loader_batch(local, sp_mesh.get_local_rank(), sp_mesh.size(), "cpu", packed=True)
    n_global = global_token_count([mb.labels], pd.get_mesh("loss"))
    loss = model(mb.tokens, positions=mb.positions, attention_mask=build_attention_mask("sdpa", mb.document_ids),
                 labels=mb.labels) / n_global
    loss.backward()
    assert_close(dist_sum(loss.detach(), pd.get_mesh("loss")).float(), ref_loss.detach(), "loss")
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert_close(full(p.grad), ref_grads[clean_name(name)], f"grad {clean_name(name)}")


@pytest.mark.parametrize("layout,world", [({"sp": 2}, 2), ({"dp_shard": 2, "sp": 2}, 4)], ids=["sp2", "dp_shard2-sp2"])
def test_packed_sft_batch_equals_one_process_and_each_sample_alone(tmp_path, layout, world):
    path = str(tmp_path / "sft.jsonl")
    write_sft(path)
    packed_batch(path)  # build the token store once, before the ranks open it
    run_distributed(_compare, world, path, layout)
