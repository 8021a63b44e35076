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
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    shift = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), shift.flatten(), ignore_index=-100)  # fp32 for bf16 models too
    loss.backward()
    return logits.detach(), loss.detach()


def check_model(ref, model, batch, mesh, sp_dim: str = "sp", grads_summed: bool = False, what: str = ""):
    """``model`` (a copy of ``ref``) under apply_ulysses gives ``ref``'s loss, logits and gradients."""
    from titan_ulysses.integrations.transformers import shard_batch, sp_loss

    ref_logits, ref_loss = reference(ref, batch)
    sp_mesh = mesh[sp_dim] if mesh.ndim > 1 else mesh
    sp, rank = sp_mesh.size(), sp_mesh.get_local_rank()
    local = shard_batch(batch, mesh, sp_dim)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
    loss = sp_loss(out.logits, local["shift_labels"], mesh)
    loss.backward()
    assert_close(loss.detach(), ref_loss, f"{what} loss")
    s_local = local["input_ids"].shape[1]
    start, end = rank * s_local, min((rank + 1) * s_local, batch["input_ids"].shape[1])
    assert_close(out.logits.detach()[:, :end - start], ref_logits[:, start:end], f"{what} logits")
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
    (command,) = re.findall(r"```bash\n(.*?)\n```", open(os.path.join(root, "docs", "transformers.md")).read(), re.S)
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
