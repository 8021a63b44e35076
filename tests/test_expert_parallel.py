"""Expert parallelism against one process: each rank's output, the load-balancing loss and every gradient
equal the reference's for the same tokens, with uneven splits and an expert one rank sends nothing."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from titan_ulysses.distributed.expert_parallel import apply_ep
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.moe.aux_loss import load_balancing_loss
from titan_ulysses.models.moe.feed_forward import MoEFeedForward

D, F, E, K = 16, 8, 4, 2


def _pair(args: MoEArgs, ep_mesh):
    torch.manual_seed(0)
    ref = MoEFeedForward(D, args)
    ref.init_weights(std=0.3)
    with torch.no_grad():
        ref.router.weight.mul_(10)
        ref.router.weight[3] = -3.0  # expert 3: wins for negative inputs only (rank 0's), never for rank 1's
    ours = MoEFeedForward(D, args)
    ours.load_state_dict(ref.state_dict())
    assert apply_ep(ours, ep_mesh) == 1
    return ref, ours


def _inputs(rank: int, world: int):
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 5 + 3 * r, D, generator=g).abs() * (-1 if r == 0 else 1) for r in range(world)]  # uneven
    return xs


def _ep_matches_one_process(args: MoEArgs):
    world, rank = dist.get_world_size(), dist.get_rank()
    pd = ParallelDims(dp_shard=world, ep=world, world_size=world)
    pd.build_mesh("cpu")
    ref, ours = _pair(args, pd.get_mesh("ep"))
    xs = _inputs(rank, world)
    ref_outs, ref_stats = zip(*[ref(x) for x in xs])
    ref_stat = ref_stats[0]
    for s in ref_stats[1:]:
        ref_stat = ref_stat + s
    ref_loss = sum(o.square().sum() for o in ref_outs) + 3 * load_balancing_loss(ref_stat)
    ref_loss.backward()

    out, stats = ours(xs[rank])
    counts, rows = stats.counts.clone(), stats.rows.clone()
    dist.all_reduce(counts), dist.all_reduce(rows)
    assert (stats.counts[3] == 0) == (rank == 1)  # rank 1 sends expert 3 nothing
    loss = out.square().sum() + 3 * load_balancing_loss(stats, counts, rows)
    loss.backward()
    assert_close(out, ref_outs[rank], "output")
    total = loss.detach().clone()
    dist.all_reduce(total)
    assert_close(total, ref_loss.detach(), "loss with the aux share")
    router_grad = ours.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank's router saw its own tokens
    assert_close(router_grad, ref.router.weight.grad, "router grad")
    local = E // world
    for name in ("w1", "w3", "w2") + (("b1", "b3", "b2") if args.expert_bias else ()):
        mine = getattr(ours.experts, name).grad.to_local()  # this rank's experts, every rank's tokens
        assert_close(mine, getattr(ref.experts, name).grad[rank * local:(rank + 1) * local], f"{name} grad")


@pytest.mark.parametrize("args", [MoEArgs(E, K, F), MoEArgs(E, K, F, router="topk_softmax", router_bias=True,
                                                              expert_bias=True, activation="clamped_swiglu")],
                         ids=["qwen3-mixtral", "gpt-oss"])
def test_expert_parallel_matches_one_process(args):
    run_distributed(_ep_matches_one_process, 2, args)


def test_ep_must_divide_the_ranks_it_borrows():
    with pytest.raises(ValueError, match=r"^expert_parallel_degree 3 must divide data_parallel_shard_degree x "
                                         r"context_parallel_degree x ulysses_degree = 4"):
        ParallelDims(dp_shard=2, sp=2, ep=3, world_size=4)
    assert ParallelDims(dp_shard=2, sp=2, ep=2, world_size=4).size("efsdp") == 2
