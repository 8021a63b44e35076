"""apply_ulysses(fused_loss=True) in the user's own loop equals one process: loss and every gradient.

Granite (its logits divided by ``logits_scaling``; with tiled MLPs) and Gemma 2 (a final logit
softcap low enough to bite; under gradient checkpointing) at sp=2 under ``fully_shard``, on test_hf_ulysses.py's batch (packed documents, ignored
labels, a length sp does not divide). The loop is docs/transformers.md's with ``shift_labels``
passed to the forward and ``sp_loss(out.loss, ...)``; the reference is transformers' own logits
and loss in one process. The forward computes no logits at all (``lm_head`` sees zero positions);
without ``shift_labels`` it gives the ordinary logits. Planted bugs (the scale or the softcap
dropped) move the loss past the tolerance; heads the fused loss cannot reproduce, a router
loss it would drop, labels it would shift within a slice or of another length and an ``lm_head``
sharded on its own are refused in one line.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from hf_fixtures import randomize

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=128, head_dim=16,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
MODELS = {
    # name: (config class, overrides, kernel, apply_ulysses options, the planted bug's FusedHead change)
    # Granite: chunks of 5 tokens and tiled MLPs (4 tokens a tile); Gemma 2: the automatic chunk, under
    # transformers' gradient checkpointing
    "granite-logits-scaling": ("GraniteConfig", dict(logits_scaling=4.0, embedding_multiplier=2.0,
                                                     residual_multiplier=0.5, attention_multiplier=0.25),
                               "sdpa", dict(loss_chunk_size=5, mlp_tile_size=4), dict(scale=1.0)),
    "gemma2-softcap": ("Gemma2Config", dict(final_logit_softcapping=3.0, attn_logit_softcapping=20.0,
                                            query_pre_attn_scalar=16, sliding_window=5), "eager", {},
                       dict(softcap=None)),
}


def build(name: str):
    cls, overrides, kernel, _, _ = MODELS[name]
    config = getattr(transformers, cls)(**{**BASE, **overrides}, attn_implementation=kernel)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize(model, 0)
    return model


def _user_loop() -> None:
    from test_hf_ulysses import make_batch, reference
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from trl.trainer.utils import add_fused_lm_head

    from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch, sp_loss

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    rank = mesh.get_local_rank()
    for name, (_, _, _, options, planted) in MODELS.items():
        ref = build(name)
        model = apply_ulysses(copy.deepcopy(ref), mesh, fused_loss=True, **options)
        if not options:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh(mesh))
        fully_shard(model, mesh=fsdp_mesh(mesh))
        batch = make_batch(ref.config.vocab_size)
        ref_logits, ref_loss = reference(ref, batch)
        local = shard_batch(batch, mesh)
        positions = []
        model.lm_head.register_forward_hook(lambda m, args, out: positions.append(out.shape[1]))
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    shift_labels=local["shift_labels"])
        assert out.logits is None and positions == [0], (name, positions)  # no [B, S/sp, V] logits, none at all
        loss = sp_loss(out.loss, local["shift_labels"], mesh)
        loss.backward()
        assert_close(loss.detach(), ref_loss, f"{name} loss")
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()  # fully_shard: the ranks' mean
                 for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            assert_close(grads[n], p.grad, f"{name} grad {n}", rtol=1e-5, atol=2e-5)
        with torch.no_grad():
            # without shift_labels: transformers' own logits, as without the option
            plain = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            s_local = plain.shape[1]
            end = min(s_local, batch["input_ids"].shape[1] - rank * s_local)
            assert_close(plain[:, :end], ref_logits[:, rank * s_local:rank * s_local + end], f"{name} logits")
            # the planted bug: the head's scale or softcap dropped
            model.ulysses_fused_head = dataclasses.replace(model.ulysses_fused_head, **planted)
            out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                        shift_labels=local["shift_labels"])
            bad = sp_loss(out.loss, local["shift_labels"], mesh)
        assert (bad - ref_loss).abs() > 1e-2 * ref_loss, (name, planted, bad, ref_loss)

    # refusals, one line each: a forward replaced on the instance, a head the fused loss does not reproduce (a logit_scale Llama never applies), a
    # router loss it would drop, a chunk without the option, labels the forward would shift within the rank's slice
    lying = transformers.LlamaConfig(**BASE, logit_scale=2.0, attn_implementation="sdpa")
    router = transformers.Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         output_router_logits=True, attn_implementation="sdpa")
    patched = build("granite-logits-scaling")
    add_fused_lm_head(patched)  # TRL's SFT and DPO trainers patch the instance's forward: it would skip the fused loss
    for model, kwargs, words in (
            (patched, dict(fused_loss=True), "replaced on the instance"),
            (transformers.AutoModelForCausalLM.from_config(lying), dict(fused_loss=True), "does not reproduce"),
            (transformers.AutoModelForCausalLM.from_config(router), dict(fused_loss=True), "output_router_logits"),
            (build("granite-logits-scaling"), dict(loss_chunk_size=8), "add fused_loss=True")):
        with pytest.raises(ValueError, match=words) as e:
            apply_ulysses(model, mesh, **kwargs)
        assert "\n" not in str(e.value)
    model = apply_ulysses(build("granite-logits-scaling"), mesh, fused_loss=True)
    ids = torch.randint(3, 100, (1, 6))
    with pytest.raises(ValueError, match="pass shift_labels=local"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(ValueError, match=r"shift_labels \(1, 12\) for hidden states \(1, 6\)"):
        model(input_ids=ids, shift_labels=ids.repeat(1, 2))  # the full rows' labels, not this rank's
    fully_shard(model.lm_head, mesh=fsdp_mesh(mesh))  # resharded after its (empty) forward: the loss would see a shard
    fully_shard(model, mesh=fsdp_mesh(mesh))
    with pytest.raises(ValueError, match="leave lm_head to the root's fully_shard"):
        model(input_ids=ids, shift_labels=ids)
    dist.barrier()


@pytest.mark.slow
def test_fused_loss_in_the_users_loop_equals_one_process():
    run_distributed(_user_loop, 2)
