"""torch.compile(fullgraph=True) of a block with Ulysses attention: no graph break, same numbers as eager."""

import copy

import pytest

import torch
import torch.distributed as dist

import extras
from dist_utils import assert_close, run_distributed
from model_harness import assert_blocks_match, small_args, split_overrides
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import apply_ulysses
from titan_ulysses.models.llama.model import Transformer


def _compiled_block_matches_eager(overrides):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    sp_mesh = pd.get_mesh("sp")
    torch.manual_seed(0)
    model_overrides, compute = split_overrides(overrides)
    args = small_args(n_layers=1, **model_overrides)
    model = Transformer(args, compute)
    model.init_weights()
    eager, twin = model.layers["0"], copy.deepcopy(model.layers["0"])
    apply_ulysses(eager, sp_mesh)
    apply_ulysses(twin, sp_mesh)
    compiled = torch.compile(twin, fullgraph=True)  # raises on any graph break

    assert_blocks_match(model, sp_mesh, eager, compiled, twin, "compiled")


@pytest.mark.parametrize("overrides", [
    # kv replication inside the compiled graph too; and the SDPA kernel order (sdpa_kernel with
    # set_priority) traced without a graph break
    dict(n_kv_heads=1, sdpa_backends="cudnn,flash"),
    dict(dim=72, n_heads=9, n_kv_heads=3),  # uneven: q heads 5/4, all-to-all with split sizes, kv expanded on rank 0
], ids=["kv1-replicated", "9heads-kv3-uneven"])
def test_compiled_ulysses_block_matches_eager(overrides):
    run_distributed(_compiled_block_matches_eager, 2, overrides)


def _compiled_memory_switches_match_eager(ac_mode, float8):
    """parallelize_llama with compile on, and every memory switch, against the same layout in eager."""
    from model_harness import build_pair, clean_name, full, make_batch, parallel_step

    from titan_ulysses.distributed.float8 import Float8Options
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.llama.parallelize import ParallelizeOptions

    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = small_args(n_kv_heads=1)
    compute = ComputeOptions(mlp_tile_size=8, loss_chunk_size=8)
    f8 = Float8Options(emulate=True) if float8 else None
    results = []
    for compile_ in (False, True):
        options = ParallelizeOptions(ac_mode=ac_mode, compile=compile_, param_dtype=torch.float32, float8=f8)
        _, model = build_pair(args, pd, options, compute)
        inputs, labels = make_batch(0, 2, 24, args.vocab_size)
        loss, _ = parallel_step(model, pd, inputs, labels)
        results.append((loss, {clean_name(n): full(p.grad) for n, p in model.named_parameters()}))
    (e_loss, e_grads), (c_loss, c_grads) = results
    tol = dict(rtol=1e-3, atol=1e-3) if float8 else dict(rtol=1e-4, atol=1e-5)
    assert_close(c_loss, e_loss, "compiled loss", **tol)
    for name, g in e_grads.items():
        assert_close(c_grads[name], g, f"compiled grad {name}", **tol)


@pytest.mark.parametrize("ac_mode, float8", [("full_offload", False),
                                             pytest.param("selective", True, marks=extras.needs("torchao"))])
def test_compile_composes_with_tiled_mlp_chunked_loss_offload_and_float8(ac_mode, float8):
    run_distributed(_compiled_memory_switches_match_eager, 2, ac_mode, float8)
