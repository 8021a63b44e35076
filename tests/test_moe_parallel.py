"""The mixture-of-experts families over sp, ep x sp and ep x dp_shard against one process: the loss
(language model + coef x load balancing) and every gradient, on trained-like weights from a
transformers model (which ``test_moe_families.py`` holds our one-process model equal to)."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import clean_name, full, make_batch, parallel_copy
from test_moe_families import MOE_VARIANTS, as_saved, hf_moe
from titan_ulysses.interop.hf_adapter import from_hf
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.step import forward_backward
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.interop.hf_config import args_from_hf_config
from titan_ulysses.models.moe.aux_loss import load_balancing_loss
from titan_ulysses.models.registry import build_model
from titan_ulysses.ops.loss import IGNORE_INDEX, cross_entropy_sum

SDPA = ComputeOptions(attn_backend="sdpa")
LAYOUTS = {"sp2": dict(sp=2), "ep2_sp2": dict(sp=2, ep=2), "ep2_dp_shard2": dict(dp_shard=2, ep=2)}
# four ranks: experts on 2 ep ranks and FSDP-sharded over the 2 outside them (their gradients add up),
# and HSDP's replicas
LAYOUTS_4 = {"ep2_sp2_dp_shard2": dict(dp_shard=2, sp=2, ep=2), "ep2_sp2_dp_replicate2": dict(dp_replicate=2, sp=2, ep=2)}


def _step(model, pd, inputs, labels, coef):
    dp, dp_rank = pd.get_mesh("dp").size(), pd.get_mesh("dp").get_local_rank()
    sp, sp_rank = pd.get_mesh("sp").size(), pd.get_mesh("sp").get_local_rank()
    mb = shard_batch(inputs.chunk(dp)[dp_rank], labels.chunk(dp)[dp_rank], sp_rank, sp)
    step = forward_backward(model, [mb], pd.get_mesh("loss"))  # the trainer's own step
    assert step.aux_coef == coef
    return step.loss + coef * step.aux


def _matches_one_process(name, layouts=LAYOUTS):
    hf = hf_moe(name)
    args = args_from_hf_config(hf.config.to_dict())
    state = from_hf(as_saved(hf, hf.state_dict()), args)
    coef = args.moe.aux_loss_coef
    inputs, labels = make_batch(0, 4, 20, args.vocab_size)
    ref = build_model(args, SDPA)
    ref.load_state_dict(state)
    logits, stats = ref(inputs, return_stats=True)
    lm = cross_entropy_sum(logits, labels) / (labels != IGNORE_INDEX).sum()
    ref_loss = lm + coef * load_balancing_loss(stats)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for layout_name, layout in layouts.items():
        pd = ParallelDims(**layout, world_size=dist.get_world_size())
        pd.build_mesh("cpu")
        model = parallel_copy(args, state, pd, ParallelizeOptions(param_dtype=torch.float32), SDPA)
        loss = _step(model, pd, inputs, labels, coef)
        assert_close(loss.float(), ref_loss.detach(), f"{name} {layout_name}: loss")
        grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters()}
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            assert_close(g, ref_grads[n], f"{name} {layout_name}: grad {n}")


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_layouts_match_one_process(name):
    run_distributed(_matches_one_process, 2, name)


def test_experts_sharded_over_ep_and_the_ranks_outside_it():
    run_distributed(_matches_one_process, 4, "qwen3_moe", LAYOUTS_4)


def _lora_on_attention(name):
    from titan_ulysses.distributed.lora import LoRAOptions, apply_lora, init_lora, resolve_targets

    hf = hf_moe(name)
    args = args_from_hf_config(hf.config.to_dict())
    lora = LoRAOptions(rank=4, alpha=8.0, targets=resolve_targets("q_proj,k_proj,v_proj,o_proj"))
    ref = build_model(args, SDPA)
    ref.load_state_dict(from_hf(as_saved(hf, hf.state_dict()), args))
    apply_lora(ref, lora, torch.float32)
    init_lora(ref, seed=1)
    with torch.no_grad():  # B far from zero: the adapters change the function
        for n, p in ref.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    coef = args.moe.aux_loss_coef
    inputs, labels = make_batch(0, 4, 20, args.vocab_size)
    logits, stats = ref(inputs, return_stats=True)
    lm = cross_entropy_sum(logits, labels) / (labels != IGNORE_INDEX).sum()
    (lm + coef * load_balancing_loss(stats)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert ref_grads and all("lora_" in n for n in ref_grads)  # the base (experts, router) is frozen
    pd = ParallelDims(sp=2, ep=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    model = parallel_copy(args, state, pd, ParallelizeOptions(param_dtype=torch.float32, lora=lora), SDPA)
    _step(model, pd, inputs, labels, coef)
    grads = {clean_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and all("lora_" in n for n in grads)  # experts and router frozen
    for n, g in grads.items():
        assert_close(g, ref_grads[n], f"{name} lora: grad {n}")


def test_lora_on_attention_of_a_mixture_of_experts():
    run_distributed(_lora_on_attention, 2, "qwen3_moe")


def _microbatches_and_logged_numbers():
    """Two microbatches per step on ep2 x sp2: each forward's load-balancing loss is its own (as
    transformers' per forward) and the step's is their mean; the step reports the language-model
    loss alone, the unweighted aux loss and the routing counts of every rank, all against one process."""
    hf = hf_moe("qwen3_moe")
    args = args_from_hf_config(hf.config.to_dict())
    state = from_hf(as_saved(hf, hf.state_dict()), args)
    coef = args.moe.aux_loss_coef
    assert coef > 0
    inputs, labels = make_batch(0, 4, 20, args.vocab_size)
    ref = build_model(args, SDPA)
    ref.load_state_dict(state)
    n = (labels != IGNORE_INDEX).sum()
    lm, aux, counts = 0.0, 0.0, 0.0
    for i, lab in zip(inputs.chunk(2), labels.chunk(2)):  # the step's microbatches, every rank's rows
        logits, stats = ref(i, return_stats=True)
        lm = lm + cross_entropy_sum(logits, lab) / n
        aux = aux + load_balancing_loss(stats) / 2
        counts = counts + stats.counts.double()
    (lm + coef * aux).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    pd = ParallelDims(sp=2, ep=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    model = parallel_copy(args, state, pd, ParallelizeOptions(param_dtype=torch.float32), SDPA)
    sp, sp_rank = pd.get_mesh("sp").size(), pd.get_mesh("sp").get_local_rank()
    mbs = [shard_batch(i, lab, sp_rank, sp) for i, lab in zip(inputs.chunk(2), labels.chunk(2))]
    step = forward_backward(model, mbs, pd.get_mesh("loss"))
    assert not hasattr(model, "router_stats")  # returned by the forward, never held (it would keep the graph)
    assert_close(step.loss.float(), lm.detach(), "language-model loss")
    assert_close(step.aux.float(), aux.detach(), "aux loss")
    torch.testing.assert_close(step.expert_counts, counts, rtol=0, atol=0)
    for k, p in model.named_parameters():
        assert_close(full(p.grad), ref_grads[clean_name(k)], f"grad {k}")
    with torch.no_grad():  # held-out evaluation: the language-model loss alone
        held_out = forward_backward(model, mbs, pd.get_mesh("loss"))
    assert held_out.aux is None
    assert_close(held_out.loss.float(), lm.detach(), "held-out loss")


def test_microbatches_average_the_aux_loss_and_the_step_reports_it():
    run_distributed(_microbatches_and_logged_numbers, 2)


def test_ep_groups_are_the_innermost_ranks_and_the_experts_fsdp_groups_the_stride_across_them():
    """dp_shard2 x sp2 x ep2 on four ranks: ep borrows the innermost ranks of dp_shard x cp x sp (ep groups
    {0,1} {2,3}, an sp=8 x ep=8 job on one node) and FSDP shards the experts over the complement ({0,2} {1,3}).
    The group rank lists of the meshes parallelize uses (``ep``, ``ep_fsdp``) are checked rank by rank on the fake
    process group: a swapped stride gives the same numbers in every layout test above."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, ep = 4, 2
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            pd = ParallelDims(dp_shard=2, sp=2, ep=ep, world_size=world)
            pd.build_mesh("cpu")
            groups = {name: dist.get_process_group_ranks(pd.get_mesh(name).get_group()) for name in ("ep", "ep_fsdp")}
        finally:
            dist.destroy_process_group()
        first = rank - rank % ep  # the ep ranks are consecutive: ep is innermost
        assert groups["ep"] == list(range(first, first + ep)), (rank, groups)
        assert groups["ep_fsdp"] == list(range(rank % ep, world, ep)), (rank, groups)
