"""The mixture-of-experts feed-forward against transformers' own blocks (Qwen3-MoE, Mixtral, gpt-oss):
output, the load-balancing loss and every gradient, on trained-like weights whose router spreads
tokens; the grouped product against its loop; an expert no token reaches."""

import pytest
import torch

from dist_utils import assert_close
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.moe.aux_loss import load_balancing_loss
from titan_ulysses.models.moe.feed_forward import MoEFeedForward
from titan_ulysses.ops.grouped_mm import grouped_mm, grouped_mm_loop

transformers = pytest.importorskip("transformers")
D, F, E, K = 32, 16, 8, 2


def _hf_block(family: str):
    g = torch.Generator().manual_seed(0)
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                          num_experts_per_tok=K, norm_topk_prob=True)
        block, args = Qwen3MoeSparseMoeBlock(cfg), MoEArgs(E, K, F, norm_topk_prob=True)
    elif family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
        block, args = MixtralSparseMoeBlock(cfg), MoEArgs(E, K, F)
    else:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
        block = GptOssMLP(cfg)
        args = MoEArgs(E, K, F, router="topk_softmax", router_bias=True, expert_bias=True,
                       activation="clamped_swiglu", swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    with torch.no_grad():  # trained-like: a router that spreads tokens, experts that differ
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "router" in name or "gate.weight" in name else 0.3))
    return block.float(), args


def _ours_from(block, args: MoEArgs) -> MoEFeedForward:
    ours = MoEFeedForward(D, args)
    router = block.router if hasattr(block, "router") else block.gate
    ex = block.experts
    with torch.no_grad():
        ours.router.weight.copy_(router.weight)
        if args.router_bias:
            ours.router.bias.copy_(router.bias)
        if args.activation == "clamped_swiglu":  # gpt-oss: [E, D, 2F], gate and up interleaved, x @ W
            ours.experts.w1.copy_(ex.gate_up_proj[..., ::2]), ours.experts.w3.copy_(ex.gate_up_proj[..., 1::2])
            ours.experts.b1.copy_(ex.gate_up_proj_bias[..., ::2]), ours.experts.b3.copy_(ex.gate_up_proj_bias[..., 1::2])
            ours.experts.w2.copy_(ex.down_proj), ours.experts.b2.copy_(ex.down_proj_bias)
        else:  # [E, 2F, D] gate then up, and [E, D, F], both F.linear (x @ W.T)
            ours.experts.w1.copy_(ex.gate_up_proj[:, :F].transpose(1, 2))
            ours.experts.w3.copy_(ex.gate_up_proj[:, F:].transpose(1, 2))
            ours.experts.w2.copy_(ex.down_proj.transpose(1, 2))
    return ours


def _hf_grad_of(block, args, name):
    ex = block.experts
    g = {"w1": None, "w3": None, "w2": None}
    if args.activation == "clamped_swiglu":
        return {"w1": ex.gate_up_proj.grad[..., ::2], "w3": ex.gate_up_proj.grad[..., 1::2], "w2": ex.down_proj.grad,
                "b1": ex.gate_up_proj_bias.grad[..., ::2], "b3": ex.gate_up_proj_bias.grad[..., 1::2],
                "b2": ex.down_proj_bias.grad}[name]
    g.update(w1=ex.gate_up_proj.grad[:, :F].transpose(1, 2), w3=ex.gate_up_proj.grad[:, F:].transpose(1, 2),
             w2=ex.down_proj.grad.transpose(1, 2))
    return g[name]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_block_matches_transformers_with_its_aux_loss(family):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    block, args = _hf_block(family)
    ours = _ours_from(block, args)
    x = torch.randn(2, 24, D, generator=torch.Generator().manual_seed(1))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    router = block.router if hasattr(block, "router") else block.gate
    logits = []
    hook = router.register_forward_hook(lambda m, i, o: logits.append(o[0]))
    out = block(xa)
    out = out[0] if isinstance(out, tuple) else out
    hook.remove()
    ref_aux = load_balancing_loss_func(tuple(logits), E, K)
    mine, stats = ours(xb)
    aux = load_balancing_loss(stats)
    assert stats.counts.min() > 0 and stats.counts.max() < 2 * K * x.shape[0] * x.shape[1] / E  # spread
    assert_close(mine, out, "output")
    assert_close(aux, ref_aux, "aux loss")
    (out.square().sum() + 10 * ref_aux).backward()
    (mine.square().sum() + 10 * aux).backward()
    assert_close(xb.grad, xa.grad, "input grad")
    assert_close(ours.router.weight.grad, router.weight.grad, "router grad")
    for name in ("w1", "w3", "w2") + (("b1", "b3", "b2") if args.expert_bias else ()):
        assert_close(getattr(ours.experts, name).grad, _hf_grad_of(block, args, name), f"expert {name} grad")


def test_an_expert_no_token_reaches_gets_a_zero_gradient():
    block, args = _hf_block("qwen3_moe")
    ours = _ours_from(block, args)
    with torch.no_grad():  # x >= 0 below, so expert 3's logit is far below every other's
        ours.router.weight[3].fill_(0.0)
        ours.router.weight[3, 0] = -1e4
    x = torch.randn(1, 16, D, generator=torch.Generator().manual_seed(2)).abs()
    out, stats = ours(x)
    assert stats.counts[3] == 0 and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(ours.experts.w1.grad[3], torch.zeros_like(ours.experts.w1.grad[3]))
    assert ours.experts.w1.grad[:3].abs().sum() > 0


def test_grouped_product_equals_its_loop_with_empty_groups():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 0, 2])
    x, w = torch.randn(10, 8, generator=g), torch.randn(5, 8, 4, generator=g)
    want = torch.cat([x[0:3] @ w[0], x[3:8] @ w[2], x[8:10] @ w[4]])
    assert torch.equal(grouped_mm_loop(x, w, counts), want)
    assert_close(grouped_mm(x, w, counts, kernel=None), want, "auto")  # the loop on CPU
    if hasattr(torch, "_grouped_mm"):  # the kernel's forward exists on CPU too (no backward there)
        assert_close(grouped_mm(x, w, counts, kernel=True), want, "kernel")
