"""integrations/transformers/: transformers' own decoders under apply_ulysses equal one process.

Loss, logits and every gradient at sp=2 and sp=3 against the same model run whole in one
process, on a batch that holds packed documents (positions restarting), ignored labels and
a length the degrees do not divide (padding): Llama with one kv head (replicated to sp),
Qwen3, Mistral with a sliding window shorter than the sequence, Gemma 3's local and global
layers (eager kernel), Qwen3-MoE, and OLMo2, a decoder the project has no family for (its q/k
norms span all heads). Weights are trained-like (hf_fixtures.randomize: sharp attention), so
a mask leak, a wrong RoPE offset or a head permutation moves the logits far past the
tolerance. Beside them: dp2 x sp2 under fully_shard with transformers' activation
checkpointing, transformers' own loss through sp_loss, and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import assert_close, run_distributed
from hf_fixtures import randomize

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BASE = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=2, vocab_size=128, head_dim=16,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    # name: (config class, overrides, kernel)
    "llama-kv1": ("LlamaConfig", dict(num_attention_heads=6, num_key_value_heads=1), "sdpa"),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=6, num_key_value_heads=2), "sdpa"),
    "mistral-window": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=5), "sdpa"),
    "gemma3-local-global": ("Gemma3TextConfig", dict(
        num_attention_heads=6, num_key_value_heads=3, sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"]), "eager"),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=6, num_key_value_heads=3, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32), "sdpa"),
    "olmo2": ("Olmo2Config", dict(num_attention_heads=6, num_key_value_heads=6), "sdpa"),
}
SEQ = 25  # padded to 26 at sp=2 and 27 at sp=3


def build(name: str, seed: int = 0):
    cls, overrides, kernel = MODELS[name]
    config = getattr(transformers, cls)(**{**BASE, **overrides}, attn_implementation=kernel)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize(model, seed)
    return model


def make_batch(vocab: int, seq: int = SEQ, batch: int = 2) -> dict:
    """Row 0 packs three documents (positions restart at 0), row 1 is one; a third of the labels ignored."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch, seq, generator=g) < 0.3] = -100
    labels[0, :seq // 2] = -100  # uneven loss tokens over the ranks: a per-rank mean would differ
    positions = torch.arange(seq).repeat(batch, 1)
    positions[0, 7:] -= 7
    positions[0, 16:] = torch.arange(seq - 16)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def reference(model, batch: dict):
    """One process, the whole batch: logits [B, S, V], transformers' mean loss, and gradients in ``model``."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                   attention_mask=batch.get("attention_mask"), use_cache=False).logits
    shift = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    if "attention_mask" in batch:  # right padding: the last real token predicts nothing
        shift = shift.masked_fill(~F.pad(batch["attention_mask"][:, 1:].bool(), (0, 1), value=False), -100)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), shift.flatten(), ignore_index=-100)  # fp32 for bf16 models too
    loss.backward()
    return logits.detach(), loss.detach()


def check_model(ref, model, batch, mesh, sp_dim: str = "sp", grads_summed: bool = False, what: str = ""):
    """``model`` (a copy of ``ref``) under apply_ulysses gives ``ref``'s loss, logits and gradients.

    Without ``position_ids`` in ``batch`` the model is called with ``input_ids`` only (and
    ``attention_mask`` when the batch has one, as one process is): the pre-hook's default positions."""
    from titan_ulysses.integrations.transformers import shard_batch, sp_loss

    ref_logits, ref_loss = reference(ref, batch)
    sp_mesh = mesh[sp_dim] if mesh.ndim > 1 else mesh
    sp, rank = sp_mesh.size(), sp_mesh.get_local_rank()
    local = shard_batch(batch, mesh, sp_dim)
    if "position_ids" in batch:
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    else:
        out = model(input_ids=local["input_ids"])
    loss = sp_loss(out.logits, local["shift_labels"], mesh)
    loss.backward()
    assert_close(loss.detach(), ref_loss, f"{what} loss")
    s_local = local["input_ids"].shape[1]
    start, end = rank * s_local, min((rank + 1) * s_local, batch["input_ids"].shape[1])
    real = batch["attention_mask"][:, start:end, None] if "attention_mask" in batch else 1  # pads' logits: any
    assert_close(out.logits.detach()[:, :end - start] * real, ref_logits[:, start:end] * real, f"{what} logits")
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not grads_summed:  # what fully_shard does by default: the mean over the ranks
            g = g.clone()
            dist.all_reduce(g, group=sp_mesh.get_group())
            g /= sp
        grads[n.replace("_checkpoint_wrapped_module.", "")] = g
    assert grads.keys() >= ref_grads.keys()
    for n, g in ref_grads.items():
        assert_close(grads[n], g, f"{what} grad {n}", rtol=1e-5, atol=2e-5)


ENGLISH = ("Sequence parallelism splits every sequence over several devices. Before attention, one all-to-all "
           "gives each device the whole sequence for a slice of the heads; after it, a second one gives the tokens "
           "back. The numbers stay those of one device, while the memory of the activations falls.")


def smollm2_batch(folder: str) -> dict:
    """make_batch's layout (packed documents, ignored labels) on real English tokens."""
    tokens = transformers.AutoTokenizer.from_pretrained(folder)(ENGLISH).input_ids
    batch = make_batch(10)
    batch["input_ids"] = torch.tensor(tokens[:2 * SEQ]).view(2, SEQ)
    batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["input_ids"])
    return batch


def _models(sp: int, names: list[str], smollm2: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titan_ulysses.integrations.transformers import apply_ulysses

    mesh = init_device_mesh("cpu", (sp,), mesh_dim_names=("sp",))
    for name in names:
        ref = build(name)
        model = apply_ulysses(copy.deepcopy(ref), mesh)
        check_model(ref, model, make_batch(ref.config.vocab_size), mesh, what=f"{name} sp={sp}")
    # input_ids only: the positions are the pre-hook's own, offset per rank (issue 43 item 9)
    ref = build("llama-kv1")
    model = apply_ulysses(copy.deepcopy(ref), mesh)
    batch = make_batch(ref.config.vocab_size)
    check_model(ref, model, {k: batch[k] for k in ("input_ids", "labels")}, mesh, what=f"input_ids only sp={sp}")
    # the real weights, first two of 30 layers: 9 q heads over 3 kv heads (5 + 4 at sp=2, uneven kv)
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, num_hidden_layers=2)
    model = apply_ulysses(copy.deepcopy(ref), mesh)
    check_model(ref, model, smollm2_batch(smollm2), mesh, what=f"SmolLM2-135M sp={sp}")


@pytest.mark.parametrize("sp", [2, 3])
def test_models_equal_one_process(sp, smollm2_hf_folder):
    run_distributed(_models, sp, sp, list(MODELS), smollm2_hf_folder)


def _dp_sp(name: str) -> None:
    """dp2 x sp2: fully_shard over every rank, transformers' activation checkpointing, transformers' own loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch, sp_loss

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    ref = build(name)
    model = apply_ulysses(copy.deepcopy(ref), mesh)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh))
    fully_shard(model, mesh=fsdp_mesh(mesh))
    batch = make_batch(ref.config.vocab_size, batch=4)
    ref_logits, ref_loss = reference(ref, batch)
    dp = mesh["dp"].get_local_rank()
    mine = {k: v[2 * dp:2 * dp + 2] for k, v in batch.items()}
    local = shard_batch(mine, mesh)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], labels=local["shift_labels"],
                shift_labels=local["shift_labels"])  # transformers' loss: the mean over this rank's tokens
    loss = sp_loss(out.loss, local["shift_labels"], mesh)
    loss.backward()
    assert_close(loss.detach(), ref_loss, f"{name} dp2 x sp2 loss")
    rank, s_local = mesh["sp"].get_local_rank(), local["input_ids"].shape[1]
    start, end = rank * s_local, min((rank + 1) * s_local, SEQ)
    assert_close(out.logits.detach()[:, :end - start], ref_logits[2 * dp:2 * dp + 2, start:end], f"{name} logits")
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        assert_close(grads[n], p.grad, f"{name} dp2 x sp2 grad {n}", rtol=1e-5, atol=2e-5)


def test_dp2_sp2_fully_shard_with_activation_checkpointing():
    run_distributed(_dp_sp, 4, "qwen3-moe")


def test_refusals_name_the_class():
    from titan_ulysses.integrations.transformers import apply_ulysses

    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=32, vocab_size=50))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=32, d_ff=32, num_layers=1, num_heads=2,
                                                                       vocab_size=50))
    for model, words in ((bert, "BertModel has non-causal"), (t5, "T5ForConditionalGeneration is an encoder-decoder"),
                         (torch.nn.Linear(2, 2), "Linear is not a transformers PreTrainedModel")):
        with pytest.raises(ValueError, match=words) as e:
            apply_ulysses(model, None)
        assert "\n" not in str(e.value)


def test_the_example_trains_and_saves(tmp_path):
    """docs/transformers.md's command: examples/hf_loop.py's 20 steps lower the loss, and transformers reloads
    the folder it saves to the loss it prints."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    blocks = re.findall(r"```bash\n(.*?)\n```", open(os.path.join(root, "docs", "transformers.md")).read(), re.S)
    (command,) = [b for b in blocks if "examples/hf_loop.py" in b]  # the other runs examples/trl_sft.py
    args = command.replace("outputs/", f"{tmp_path}/").split()
    assert args[0] == "torchrun"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args[1:]], cwd=root, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": root}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    first, last, check = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+) in 20 steps.*first rows ([\d.]+)",
                                              out.stdout).groups())
    assert last < first - 1.0, out.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp_path}/hf_loop")
    assert model.config._attn_implementation == "sdpa" and check < first - 1.0


def _edge_cases() -> None:
    """Issue 43 items 7-9 on 2 ranks: right padding (exact labels, then end to end), refused masks, an sp dim of
    size 1, a batch without loss tokens, and transformers' own loss on a rank without loss tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    from titan_ulysses.integrations.transformers import apply_ulysses, shard_batch, sp_loss

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp"))
    rank = mesh["sp"].get_local_rank()
    # the label shift under right padding: the last real token predicts nothing, not the pad
    local = shard_batch({"input_ids": torch.tensor([[5, 6, 7, 8, 0, 0]]),
                         "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]])}, mesh)
    assert local["shift_labels"].tolist() == [[[6, 7, 8], [-100, -100, -100]][rank]]
    with pytest.raises(ValueError, match="padding before real tokens"):  # left padding
        shard_batch({"input_ids": torch.tensor([[0, 0, 5, 6]]), "attention_mask": torch.tensor([[0, 0, 1, 1]])}, mesh)
    with pytest.raises(ValueError, match="size 1, nothing to split"):
        apply_ulysses(build("llama-kv1"), mesh, sp_dim="dp")

    # a right-padded batch end to end: rows of 25 and 17 real tokens, the mask kept by one process
    ref = build("llama-kv1")
    model = apply_ulysses(copy.deepcopy(ref), mesh)
    batch = make_batch(ref.config.vocab_size)
    del batch["position_ids"]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, 17:] = 0
    batch["input_ids"][1, 17:] = 0
    check_model(ref, model, batch, mesh, what="right padding sp=2")
    # the tiled MLP option (4 tokens a tile, 13 per rank: a short last tile): exact, and tiled in forward
    ref.zero_grad()
    tiled = apply_ulysses(copy.deepcopy(ref), mesh, mlp_tile_size=4)
    calls = []
    tiled.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))
    check_model(ref, tiled, batch, mesh, what="tiled MLP sp=2")
    assert calls[:4] == [4, 4, 4, 1], calls

    local = shard_batch(batch, mesh)
    for mask, why in ((torch.ones_like(local["input_ids"]).index_fill_(1, torch.tensor([3]), 0), "padding"),
                      (torch.ones(1, local["input_ids"].shape[1], dtype=torch.long), "broadcast [1, S/sp]")):
        with pytest.raises(ValueError, match="attention_mask of shape"):  # a mask reaching the forward
            model(input_ids=local["input_ids"], attention_mask=mask)

    # no loss token on the whole mesh: loss 0 and zero gradients, not NaN
    model.zero_grad()
    out = model(**{k: local[k] for k in ("input_ids", "position_ids")})
    loss = sp_loss(out.logits, torch.full_like(local["shift_labels"], -100), mesh)
    loss.backward()
    assert loss.item() == 0 and all(not p.grad.any() for p in model.parameters() if p.grad is not None)

    # transformers' own loss while rank 1 holds no loss token (its mean is NaN): equal to one process
    ref.zero_grad()
    model.zero_grad()
    batch = make_batch(ref.config.vocab_size)
    batch["labels"][:, 12:] = -100  # rank 1's tokens are 13..25: every shifted label there is ignored
    _, ref_loss = reference(ref, batch)
    local = shard_batch(batch, mesh)
    sl = local["shift_labels"]
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], labels=sl, shift_labels=sl)
    assert rank == 0 or out.loss.isnan()
    loss = sp_loss(out.loss, sl, mesh)
    loss.backward()
    assert_close(loss.detach(), ref_loss, "transformers' loss, a rank without loss tokens")
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        assert_close(g / 2, dict(ref.named_parameters())[n].grad, f"grad {n}", rtol=1e-5, atol=2e-5)


def test_padding_masks_and_empty_ranks():
    run_distributed(_edge_cases, 2)
