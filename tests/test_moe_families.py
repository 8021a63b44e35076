"""Qwen3-MoE, Mixtral and gpt-oss against transformers' own forward, in one process: logits, the
load-balancing loss and every gradient of (language-model loss + coef x aux loss), on trained-like
weights whose routers spread tokens; and the Hugging Face names both ways."""

import dataclasses

import pytest
import torch

from dist_utils import assert_close
from hf_fixtures import BASE, randomize
from titan_ulysses.interop.hf_adapter import from_hf, to_hf
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.interop.hf_config import args_from_hf_config
from titan_ulysses.models.moe.aux_loss import load_balancing_loss
from titan_ulysses.models.registry import build_model
from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum

transformers = pytest.importorskip("transformers")

MOE_VARIANTS = {
    # one dense layer (mlp_only_layers), renormalised top-k, q/k norms, head_dim != dim / heads
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1],
                                    output_router_logits=True, router_aux_loss_coef=0.02)),
    # a window shorter than the sequence
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=9,
                                output_router_logits=True, router_aux_loss_coef=0.02)),
    # sinks, biases everywhere, sliding / full layers, YaRN, the clamped SwiGLU, top-k then softmax
    "gpt_oss": ("gpt_oss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=7,
                                layer_types=["sliding_attention", "full_attention"], output_router_logits=True,
                                router_aux_loss_coef=0.02, rope_parameters={
                                    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0},
                                max_position_embeddings=64)),
}


def hf_moe(name: str, seed: int = 0):
    model_type, overrides = MOE_VARIANTS[name]
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, "intermediate_size": 24, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    randomize(model, seed)
    with torch.no_grad():  # routers that spread tokens; sinks and expert weights far from zero
        for n, p in model.named_parameters():
            if n.endswith(("mlp.gate.weight", "router.weight", "block_sparse_moe.gate.weight")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
            elif n.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 2)))
            elif p.dim() == 3 or ".experts." in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 3)))
    return model


def as_saved(hf, tensors: dict) -> dict:
    """``tensors`` (named as hf's parameters in memory) in the layout ``save_pretrained`` writes: the Hub's
    (transformers 5 fuses experts in memory, per-expert tensors on disk)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.detach().clone() for k, v in revert_weight_conversion(hf, dict(tensors)).items()}


def ours_from(hf) -> torch.nn.Module:
    args = args_from_hf_config(hf.config.to_dict())
    model = build_model(args, ComputeOptions(attn_backend="sdpa"))
    model.load_state_dict(from_hf(as_saved(hf, hf.state_dict()), args))
    return model


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_family_matches_transformers(name):
    hf = hf_moe(name)
    ours = ours_from(hf)
    args = ours.args
    assert args.moe is not None and args.moe.aux_loss_coef == 0.02
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.vocab_size, (2, 21), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 21), generator=g)
    labels[0, :5] = IGNORE_INDEX
    out = hf(tokens, output_router_logits=True)
    ref_lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    logits, stats = ours(tokens, return_stats=True)
    assert stats.counts.min() > 0  # every expert routed to
    aux = load_balancing_loss(stats)
    assert_close(logits, out.logits, "logits")
    assert_close(aux, out.aux_loss, "aux loss")
    lm = cross_entropy_sum(logits, labels) / (labels != IGNORE_INDEX).sum()
    (ref_lm + 0.02 * out.aux_loss).backward()
    (lm + 0.02 * aux).backward()
    theirs = to_hf({n: p.grad for n, p in ours.named_parameters()}, args)
    hf_grads = as_saved(hf, {n: p.grad for n, p in hf.named_parameters()})
    assert set(theirs) == set(hf_grads)
    for key, grad in theirs.items():
        assert_close(grad, hf_grads[key], f"grad {key}")


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_names_round_trip(name):
    hf = hf_moe(name)
    args = args_from_hf_config(hf.config.to_dict())
    saved = as_saved(hf, hf.state_dict())
    back = to_hf(from_hf(saved, args), args)
    assert set(back) == set(saved)
    for key, w in saved.items():
        assert torch.equal(back[key], w), key
    assert dataclasses.asdict(args)["moe"]["num_experts"] == args.moe.num_experts


def test_what_a_mixture_of_experts_cannot_combine_with_is_refused_in_one_line():
    from titan_ulysses.models.moe.checks import check_moe

    moe = args_from_hf_config(hf_moe("qwen3_moe").config.to_dict())  # 8 experts, layer 1 dense
    dense = dataclasses.replace(moe, moe=None, moe_dense_layers=[])
    check_moe(moe, 4, 1, ("q_proj", "o_proj"), "x")  # attention LoRA and a dividing ep: fine
    for args, ep, tp, lora, message in [
        (dense, 2, 1, None, "parallelism.expert_parallel_degree 2 needs a mixture-of-experts model; x has no experts"),
        (moe, 3, 1, None, "parallelism.expert_parallel_degree 3 does not divide the 8 experts of x; use one of "
                          "[1, 2, 4, 8]"),
        (moe, 1, 2, None, "parallelism.tensor_parallel_degree 2 with a mixture of experts (x) is not supported"),
        (moe, 1, 1, ("q_proj", "up_proj"), "lora.target_modules up_proj: LoRA on experts is not supported"),
    ]:
        with pytest.raises(ValueError, match="^" + __import__("re").escape(message)):
            check_moe(args, ep, tp, lora, "x")
