"""torch.compile(fullgraph=True) of a block with Ulysses attention: no graph break, same numbers as eager."""

import copy

import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import small_args
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import apply_ulysses
from titan_ulysses.models.llama.model import Transformer


def _compiled_block_matches_eager():
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp_mesh = pd.get_mesh("sp")
    torch.manual_seed(0)
    args = small_args(n_layers=1, n_kv_heads=1)  # kv replication inside the compiled graph too
    model = Transformer(args)
    model.init_weights()
    eager, twin = model.layers["0"], copy.deepcopy(model.layers["0"])
    apply_ulysses(eager, sp_mesh)
    apply_ulysses(twin, sp_mesh)
    compiled = torch.compile(twin, fullgraph=True)  # raises on any graph break

    tokens = torch.randint(0, args.vocab_size, (2, 16))
    batch = shard_batch(tokens, tokens, sp_mesh.get_local_rank(), sp_mesh.size())
    x = model.tok_embeddings(batch.tokens).detach()  # [B, S/sp, D]
    rope = model.rope(batch.positions)
    grad = torch.randn_like(x)

    outs = []
    for block, params in ((eager, eager), (compiled, twin)):
        xi = x.clone().requires_grad_()
        out = block(xi, rope)
        out.backward(grad)
        outs.append((out.detach(), xi.grad, {n: p.grad for n, p in params.named_parameters()}))
    (e_out, e_dx, e_grads), (c_out, c_dx, c_grads) = outs
    assert_close(c_out, e_out, "compiled output", rtol=1e-4, atol=1e-5)
    assert_close(c_dx, e_dx, "compiled input grad", rtol=1e-4, atol=1e-5)
    for name, g in e_grads.items():
        assert_close(c_grads[name], g, f"compiled grad {name}", rtol=1e-4, atol=1e-5)


def test_compiled_ulysses_block_matches_eager():
    run_distributed(_compiled_block_matches_eager, 2)
