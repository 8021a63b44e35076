"""apply_ulysses(..., head_stages=G): exact against one process, and one stage's full-sequence tensors at a time.

At sp=2 with 2 stages (and 4 for the Llama), loss, logits and every gradient equal the whole model in one process
(test_hf_ulysses.check_model, trained-like weights: a stage writing the wrong head slots moves
the logits far past the tolerance): a GQA Llama (8 q / 2 kv heads: the even exchange), a
Llama with 9 q / 3 kv heads (SmolLM2's: 5 and 4 q heads per rank, the uneven exchange, stages
of 3 + 2 and 2 + 2 heads), Gemma 2 on its eager kernel (a window shorter than the sequence on one layer,
logit softcapping) with transformers' activation checkpointing on top and fully_shard, and
GPT-OSS (attention sinks, split per q head; one document per row: its own forward ignores
packed positions when it builds masks).

Memory: a dispatch mode counts the live bytes of full-sequence attention tensors (4-d outputs
whose sequence dim is the whole S) through forward and backward of a 1-layer model with 8 q
and 8 kv heads (4 + 4 per rank). Plain Ulysses saves the layer's full-sequence q/k/v/out for
backward, where their gradients join them; with G stages each stage is checkpointed, so the
live set at any time is one stage's: the same ops on 1/G of the rank's q and kv heads, hence
peak(G) <= peak(1) / G. (With GQA a kv head shared by one stage's q heads is resent in every
stage: that part does not shrink, so the test takes kv heads the stages split.) Without the
per-stage checkpoint the stages' tensors pile up until backward and the bound fails.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dist_utils import run_distributed
from test_hf_ulysses import BASE, check_model, make_batch

transformers = pytest.importorskip("transformers")

STAGED = {
    # name: (config class, overrides, kernel)
    "llama-gqa": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2), "sdpa"),
    "llama-uneven": ("LlamaConfig", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=144), "sdpa"),
    "gemma2-window-softcap": ("Gemma2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "gpt-oss-sinks": ("GptOssConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"]), "eager"),
}


def build(name: str, seed: int = 0, **extra):
    from hf_fixtures import randomize

    cls, overrides, kernel = STAGED[name]
    config = getattr(transformers, cls)(**{**BASE, **overrides, **extra}, attn_implementation=kernel)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize(model, seed)
    return model


class FullSequenceBytes(TorchDispatchMode):
    """Live and peak bytes of the storages of 4-d op outputs whose dim 1 or 2 is the full sequence ``seq``
    ([B, S, h, D] / [B, h, S, D] q/k/v/out, [B, h, S, S] weights, their gradients); masks ([B, 1, S, S]) left out."""

    def __init__(self, seq: int):
        super().__init__()
        self.seq, self.live, self.peak, self._alive = seq, 0, 0, set()

    def _free(self, key, n):
        self._alive.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not (isinstance(t, torch.Tensor) and t.dim() == 4 and self.seq in t.shape[1:3] and t.shape[1] != 1):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._alive:  # a view of a storage already counted
                continue
            self._alive.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def _peak_full_sequence_bytes(model, local, mesh, seq: int) -> int:
    from titan_ulysses.integrations.transformers import sp_loss

    with FullSequenceBytes(seq) as meter:
        out = model(input_ids=local["input_ids"])
        sp_loss(out.logits, local["shift_labels"], mesh).backward()
    return meter.peak


def _staged(names: list[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    for name in names:
        ref = build(name)
        model = apply_ulysses(copy.deepcopy(ref), mesh, head_stages=2)
        checkpointed = name.startswith("gemma2")
        if checkpointed:  # transformers' activation checkpointing around the stages' own, under FSDP2
            model.gradient_checkpointing_enable()
            model.train()
            for layer in model.model.layers:
                fully_shard(layer, mesh=fsdp_mesh(mesh))
            fully_shard(model, mesh=fsdp_mesh(mesh))
        batch = make_batch(ref.config.vocab_size)
        if name.startswith("gpt-oss"):  # its one-process forward builds masks without position_ids: no packing
            batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).repeat(len(batch["input_ids"]), 1)
        check_model(ref, model, batch, mesh, what=f"{name} head_stages=2")
    ref = build("llama-gqa")  # 4 stages of one q head each, all four sharing the rank's kv head
    check_model(ref, apply_ulysses(copy.deepcopy(ref), mesh, head_stages=4), make_batch(128), mesh,
                what="llama-gqa head_stages=4")
    with pytest.raises(ValueError, match=r"^apply_ulysses: head_stages 3 does not divide the 4 q heads per rank"):
        apply_ulysses(build("llama-gqa"), mesh, head_stages=3)  # wired in: refused before the model is touched

    # memory: one layer, 8 q and 8 kv heads, 4 + 4 per rank; input_ids only (sdpa's causal mask is no tensor)
    batch = make_batch(128, seq=64)
    local = shard_batch({k: batch[k] for k in ("input_ids", "labels")}, mesh)
    peaks = {}
    for stages in (1, 2, 4):
        model = apply_ulysses(build("llama-gqa", num_hidden_layers=1, num_key_value_heads=8), mesh, head_stages=stages)
        peaks[stages] = _peak_full_sequence_bytes(model, local, mesh, 64)
    if torch.distributed.get_rank() == 0:
        print(f"peak bytes of full-sequence attention tensors, 1 layer, sp=2, S=64: {peaks}")
    assert peaks[1] > 0 and peaks[2] * 2 <= peaks[1] and peaks[4] * 4 <= peaks[1], peaks


@pytest.mark.slow
def test_head_stages_equal_one_process_and_hold_one_stage():
    run_distributed(_staged, 2, list(STAGED))


def test_head_stages_refusals():
    """One line naming head_stages and the counts that work: arithmetic, no process group."""
    from titan_ulysses.integrations.transformers.staged import check_stages

    cases = [((3, 8, 2, 2), r"^apply_ulysses: head_stages 3 does not divide the 4 q heads per rank \(8 heads over "
                            r"sp 2\); use one of \[1, 2, 4\]$"),
             ((4, 6, 3, 2), r"^apply_ulysses: head_stages 4 is more than the 3 q heads a rank attends \(6 heads over "
                            r"sp 2\); use at most 3$"),
             ((0, 8, 2, 2), r"^apply_ulysses: head_stages must be an integer >= 1 \(1 = off\), got 0$"),
             ((True, 8, 2, 2), r"^apply_ulysses: head_stages must be an integer >= 1")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            check_stages(*args)
        assert "\n" not in str(e.value)
    check_stages(3, 6, 3, 2)  # uneven split: 3 and 3 heads per rank (6 over 2 with 3 kv heads) take 3 stages
