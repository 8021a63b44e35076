"""integrations/transformers/: what apply_ulysses, shard_batch and sp_loss refuse, in one line each.

Hybrid decoders whose token-mixing layers are not all attention (LFM2's convolutions,
GraniteMoeHybrid's mamba, RecurrentGemma's recurrence) would compute each rank's slice on
its own: they are refused by a probe that finds any module mixing tokens outside
transformers' attention interface (mixing.py), while Llama passes it. Single process: the
refusals come before any collective.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, vocab_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
HYBRIDS = {
    # name: (config, the layer and class the refusal must name)
    "lfm2": (lambda: transformers.Lfm2Config(**BASE, layer_types=["full_attention", "conv"]),
             "model.layers.1.conv (Lfm2ShortConv)"),
    "granitemoehybrid": (lambda: transformers.GraniteMoeHybridConfig(
        **BASE, layer_types=["attention", "mamba"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
        num_local_experts=2, num_experts_per_tok=1), "model.layers.1.mamba (GraniteMoeHybridMambaLayer)"),
    "recurrentgemma": (lambda: transformers.RecurrentGemmaConfig(
        **{k: v for k, v in BASE.items() if k != "max_position_embeddings"}, lru_width=64, attention_window_size=8,
        block_types=["attention", "recurrent"]), "model.layers.1.temporal_block.rg_lru (RecurrentGemmaRglru)"),
}


def tiny(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def one_line(fn, *args, match: str, **kwargs):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_token_mixers_are_refused(name):
    from titan_ulysses.integrations.transformers import apply_ulysses

    config, layer = HYBRIDS[name]
    model = tiny(config())
    kernel = model.config._attn_implementation
    message = one_line(apply_ulysses, model, None, match="mixes tokens outside transformers' attention interface")
    assert f"{type(model).__name__}'s {layer}" in message
    assert model.config._attn_implementation == kernel  # the probe leaves the model as it was


def test_llama_passes_the_probe():
    """The control: Llama's only token mixer is attention (rotary, norms, MLP are token-local)."""
    from titan_ulysses.integrations.transformers.mixing import token_mixer

    model = tiny(transformers.LlamaConfig(**BASE))
    assert token_mixer(model) is None
    # and the probe does find a mixer planted in it: a causal running mean over the MLP's output
    mlp = model.model.layers[1].mlp
    forward = mlp.forward
    mlp.forward = lambda x: forward(x).cumsum(1)
    assert token_mixer(model) == "model.layers.1.mlp (LlamaMLP)"


def test_meta_weights_are_refused():
    from titan_ulysses.integrations.transformers import apply_ulysses

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE))
    one_line(apply_ulysses, model, None, match="weights on the meta device")


def test_bad_arguments_are_one_line():
    """Each was a traceback (issue 43 item 8): no mesh, a mask one column short, 1-D ids, labels one column short."""
    from titan_ulysses.integrations.transformers import apply_ulysses, shard_batch, sp_loss

    one_line(apply_ulysses, tiny(transformers.LlamaConfig(**BASE)), None, match="mesh is NoneType, not a DeviceMesh")
    ids = torch.randint(3, 100, (2, 8))
    one_line(shard_batch, {"input_ids": ids, "attention_mask": torch.ones(2, 7)}, None,
             match=r"attention_mask has shape \(2, 7\), input_ids \(2, 8\)")
    one_line(shard_batch, {"input_ids": ids, "attention_mask": torch.ones(1, 8)}, None,  # broadcast over the rows
             match=r"attention_mask has shape \(1, 8\)")
    one_line(shard_batch, {"input_ids": ids[0]}, None, match=r"input_ids has shape \(8,\); pass \[batch, seq\]")
    one_line(sp_loss, torch.randn(2, 8, 100), ids[:, :7], None, match=r"logits \(2, 8, 100\) and labels \(2, 7\)")


@pytest.mark.parametrize("options, match", [
    (dict(mlp_tile_size=-1), r"mlp_tile_size must be an integer >= 0 \(0 = off\), got -1$"),
    (dict(head_stages=0), r"head_stages must be an integer >= 1 \(1 = off\), got 0$"),
    (dict(head_stages=2.0), r"head_stages must be an integer >= 1 \(1 = off\), got 2.0$"),
    (dict(loss_chunk_size=-8), r"loss_chunk_size must be an integer >= 0 \(0 = automatic\), got -8$"),
    (dict(fused_loss="yes"), r"fused_loss='yes' must be True or False$")])
def test_memory_options_of_the_wrong_type_or_range_are_one_line(options, match):
    """Checked before the model or the mesh is touched: a negative tile or chunk was silently off before."""
    from titan_ulysses.integrations.transformers import apply_ulysses, ulysses_trainer

    one_line(apply_ulysses, tiny(transformers.LlamaConfig(**BASE)), None, match="^apply_ulysses: " + match, **options)
    if "fused_loss" not in options:  # ulysses_trainer turns the fused loss on with loss_chunk_size
        one_line(ulysses_trainer, object(), 2, match="^ulysses_trainer: " + match, **options)


def test_unsupported_trl_trainers_are_refused():
    """GRPO (generation and rewards) and the other TRL trainers cannot be split exactly: one line naming the class."""
    from types import SimpleNamespace

    trl = pytest.importorskip("trl")
    from titan_ulysses.integrations.transformers import ulysses_trainer

    for cls in (trl.GRPOTrainer, trl.RLOOTrainer, trl.KTOTrainer):
        trainer = cls.__new__(cls)  # the check reads the class and args only: no model, no process group
        trainer.args = SimpleNamespace()
        one_line(ulysses_trainer, trainer, 2, match=f"{cls.__name__} is not supported")
    sub = type("MyGRPO", (trl.GRPOTrainer,), {})  # a user's subclass is refused by what it derives from
    trainer = sub.__new__(sub)
    trainer.args = SimpleNamespace()
    one_line(ulysses_trainer, trainer, 2, match="GRPOTrainer is not supported")


def test_the_fused_head_loss_takes_gemma2s_final_logit_softcap():
    """ulysses_trainer(loss_chunk_size=N)'s loss on a softcapped head (Gemma 2) equals transformers' own logits'
    summed cross-entropy, value and gradients (it was refused before the loss registry took ``softcap=``)."""
    import transformers

    from titan_ulysses.integrations.transformers.memory import fused_head_refusal, fused_loss_sum

    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    final_logit_softcapping=3.0, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)  # logits well past the softcap: its tanh matters
    assert fused_head_refusal(model) is None
    hidden = torch.randn(2, 7, 32, requires_grad=True)
    labels = torch.randint(0, 96, (2, 7))
    labels[0, :3] = -100
    fused = fused_loss_sum(model, hidden, labels, chunk_size=4)
    fused.backward()
    got_h, got_w = hidden.grad.clone(), model.lm_head.weight.grad.clone()
    hidden.grad, model.lm_head.weight.grad = None, None
    logits = model.lm_head(hidden)
    logits = 3.0 * torch.tanh(logits / 3.0)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    ref.backward()
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, model.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
    uncapped = torch.nn.functional.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten(),
                                                 reduction="sum")
    assert (uncapped - ref).abs() > 1e-2 * ref.abs()  # the softcap is not a no-op at these weights


def test_fsdp1_under_the_trainer_is_refused():
    """FSDP2 is what ulysses_trainer runs and tests (test_hf_trainer.py); FSDP1 (deprecated in transformers) is one line."""
    from types import SimpleNamespace

    from titan_ulysses.integrations.transformers import ulysses_trainer

    trainer = transformers.Trainer.__new__(transformers.Trainer)  # the check reads args only: no model, no group
    trainer.args, trainer.compute_metrics, trainer.compute_loss_func = SimpleNamespace(
        fsdp_plugin_args={"fsdp_version": 1}), None, None
    one_line(ulysses_trainer, trainer, 2, match=r"FSDP1 \(fsdp_config version 1\) is not supported")
