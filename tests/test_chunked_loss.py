"""Chunked cross-entropy equals the plain path, in the op and through the sharded model."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import build_pair, clean_name, full, make_batch, small_args
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import dist_sum
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.ops.loss import IGNORE_INDEX, linear_cross_entropy_sum


@pytest.mark.parametrize("backend", ["fused", "chunked"])
@pytest.mark.parametrize("chunk", [0, 1, 5, 64])
def test_chunked_matches_plain(chunk, backend):
    torch.manual_seed(0)
    hidden = torch.randn(2, 13, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 32, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 13))
    labels[0, :4] = IGNORE_INDEX
    plain = linear_cross_entropy_sum(hidden, weight, labels, backend="materialized")
    g_h, g_w = torch.autograd.grad(plain * 0.37, (hidden, weight))
    chunked = linear_cross_entropy_sum(hidden, weight, labels, backend=backend, chunk_size=chunk)
    c_h, c_w = torch.autograd.grad(chunked * 0.37, (hidden, weight))
    torch.testing.assert_close(chunked.double(), plain.double())
    torch.testing.assert_close(c_h, g_h)
    torch.testing.assert_close(c_w, g_w)


def _sharded_chunked_loss_matches_reference():
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(tie_embeddings=True)
    ref, model = build_pair(args, pd, ParallelizeOptions(param_dtype=torch.float32), ComputeOptions(loss_chunk_size=3, loss_backend="chunked"))
    inputs, labels = make_batch(0, 2, 13, args.vocab_size)
    n = (labels != IGNORE_INDEX).sum()
    ref_loss = torch.nn.functional.cross_entropy(
        ref(inputs).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum") / n
    ref_loss.backward()
    sp = pd.get_mesh("sp")
    mb = shard_batch(inputs, labels, sp.get_local_rank(), sp.size())
    loss = model(mb.tokens, positions=mb.positions, labels=mb.labels) / n
    loss.backward()
    assert_close(dist_sum(loss.detach(), pd.get_mesh("loss")), ref_loss.detach(), "loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert_close(full(p.grad), ref_params[clean_name(name)].grad, f"grad {name}")


def test_sharded_model_with_chunked_loss_matches_reference():
    run_distributed(_sharded_chunked_loss_matches_reference, 2)


def test_tiled_mlp_matches_plain_and_saves_only_its_input():
    from titan_ulysses.models.decoder.feed_forward import FeedForward

    torch.manual_seed(0)
    plain, tiled = FeedForward(16, 48), FeedForward(16, 48, tile_size=5)
    tiled.load_state_dict(plain.state_dict())
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    plain.double(), tiled.double()
    outs = []
    for mlp in (plain, tiled):
        xi = x.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = mlp(xi)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), xi.grad, [p.grad for p in mlp.parameters()], sum(saved)))
    (po, px, pg, p_saved), (to, tx, tg, t_saved) = outs
    torch.testing.assert_close(to, po)
    torch.testing.assert_close(tx, px)
    for a, b in zip(tg, pg):
        torch.testing.assert_close(a, b)
    # the tiled MLP keeps its input and weights, never [B, S, 48] intermediates
    assert t_saved == x.numel() + sum(p.numel() for p in tiled.parameters())
    assert p_saved > t_saved + 2 * 13 * 48
