"""The memory estimate against what a real step keeps, and the estimator script's answers.

What CPU can measure exactly is what autograd saves for backward (counted by storage
through saved-tensor hooks, with ``ops/attention.py`` choosing its kernels as on CUDA) and
the size of each rank's parameter shards; both are compared with the estimate at sp=1 and,
on two gloo ranks, at sp=2. The whole-step peak, phase by phase, is compared with PyTorch's
memory tracker under fake tensors in ``tests/test_memory_track.py``, and on CUDA by
``scripts/estimate_memory.py --validate``.
"""

import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import apply_ulysses
from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.fake_step import cuda_kernel_choices
from titan_ulysses.planning.track import track_step
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
from titan_ulysses.models.flavors import get_flavor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import estimate_memory  # noqa: E402
from estimate_memory import saved_bytes  # noqa: E402

SEQ = 512


def expected_saved(args, layout, switches, tokens_per_rank, fsdp: bool = True) -> float:
    est = estimate(args, layout, switches, tokens_per_rank * layout.sp)
    # materialized, cross-entropy keeps its fp32 log-probabilities (the logits themselves are not kept); fused
    # keeps the gradients it made in forward: the output weight's fp32 [V, D], and the hidden states' [T, D]
    # in place of the final norm's output, which the others keep (the estimate's saved head)
    logits = {"materialized": tokens_per_rank * args.vocab_size * 4, "chunked": 0,
              "fused": 4 * args.vocab_size * args.dim}[switches.loss_backend]
    # a model without FSDP keeps no per-block bf16 copy of the RoPE tables (FSDP's input cast makes them)
    rope = 0 if fsdp or switches.act_bytes == 4 or switches.ac_mode == "full_offload" else (
        args.n_layers * switches.act_bytes * args.head_dim * tokens_per_rank)
    return est.saved_activations + logits - rope


CASES = {
    "plain": ({}, "none", torch.float32),
    "plain_bf16": ({}, "none", torch.bfloat16),
    "ac_full": ({}, "full", torch.float32),
    "tiled_mlp": ({"mlp_tile_size": 64}, "none", torch.float32),
    "chunked_loss_bf16": ({"loss_backend": "chunked", "loss_chunk_size": 64}, "none", torch.bfloat16),
    "materialized_loss": ({"loss_backend": "materialized"}, "none", torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_saved_activations_match_the_estimate(case):
    overrides, ac, dtype = CASES[case]
    args = get_flavor("debugmodel")
    model = Transformer(args, ComputeOptions(**overrides)).to(dtype)
    apply_ac(model, ac)
    with cuda_kernel_choices():  # fp32 GQA: kv heads expanded for CUDA's non-flash kernels
        measured = saved_bytes(model, torch.randint(0, args.vocab_size, (1, SEQ)))
    switches = Switches(ac_mode=ac, act_bytes=torch.finfo(dtype).bits // 8, **overrides)
    expected = expected_saved(args, Layout(), switches, SEQ, fsdp=False)
    assert abs(expected - measured) / measured < 0.01, (expected, measured)


def _sp2_matches():
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    args = get_flavor("debugmodel_gqa1")  # one kv head, replicated to both ranks
    model = Transformer(args)
    apply_ulysses(model, pd.get_mesh("sp"))
    rank = pd.get_mesh("sp").get_local_rank()
    tokens = torch.randint(0, args.vocab_size, (1, SEQ // 2))
    with cuda_kernel_choices():
        measured = saved_bytes(model, tokens, torch.arange(rank * SEQ // 2, (rank + 1) * SEQ // 2))
    expected = expected_saved(args, Layout(sp=2), Switches(act_bytes=4), SEQ // 2)
    assert abs(expected - measured) / measured < 0.01, (expected, measured)
    # the parameter shards FSDP leaves on this rank, against the estimate's parameter term
    with torch.device("meta"):
        sharded = Transformer(args)
    parallelize_decoder(sharded, pd, ParallelizeOptions(param_dtype=torch.float32))
    local = sum(p.to_local().numel() * 4 for p in sharded.parameters())
    est = estimate(args, Layout(sp=2), Switches(act_bytes=4), SEQ)
    assert abs(est.parameters - local) / local < 0.01, (est.parameters, local)


def test_sp2_saved_activations_and_parameter_shards_match_the_estimate():
    run_distributed(_sp2_matches, 2)


def test_each_switch_moves_its_term():
    args = get_flavor("8B")
    base = Switches(loss_backend="materialized")
    plain = estimate(args, Layout(sp=8), base, 131072)
    assert estimate(args, Layout(sp=8), dataclasses.replace(base, ac_mode="full"), 131072).saved_activations \
        < plain.saved_activations / 5
    # 16384 local tokens: unchunked, the fp32 log-probabilities, their gradient and log_softmax's backward
    # output (12 bytes per logit); chunked, one 2048-token chunk's fp32 logits and softmax (8 bytes)
    assert plain.logits == pytest.approx(12 * 16384 * args.vocab_size)
    chunked = estimate(args, Layout(sp=8), dataclasses.replace(base, loss_backend="chunked", loss_chunk_size=2048),
                       131072)
    assert chunked.logits == pytest.approx(8 * 2048 * args.vocab_size)
    # the loss backward phase trades the logits for the chunked loss's fp32 [V, D] and [T, D] gradients
    assert plain.phases["loss backward"] - chunked.phases["loss backward"] == pytest.approx(
        plain.logits - chunked.logits - chunked.loss_weight_gradient)
    # tiled MLP (ops/tiled.py): the output's and input's [T, D] gradients beside one 2048-token tile's recompute
    # and gradients (6 [tile, F] and 2 [tile, D] tensors) and the MLP weights' gradients (sums, the previous
    # tile's and the one being made: 7 [D, F]), instead of two [T, F] gradients beside the recompute
    tiled = estimate(args, Layout(sp=8), dataclasses.replace(base, mlp_tile_size=2048), 131072)
    f, d = args.ffn_hidden_dim, args.dim
    assert plain.mlp_working_set == pytest.approx(2 * 2 * f * 16384)
    assert tiled.mlp_working_set == pytest.approx(2 * 2 * d * 16384 + 2 * (6 * f + 2 * d) * 2048 + 7 * 2 * d * f)
    double = estimate(args, Layout(sp=4), base, 131072)  # (at sp=16 kv heads would be replicated)
    assert plain.saved_activations == pytest.approx(double.saved_activations / 2, rel=0.02)
    offload = estimate(args, Layout(sp=8), dataclasses.replace(base, cpu_offload=True), 131072)
    assert offload.parameters == offload.gradients == offload.optimizer == 0
    assert offload.host_offloaded == pytest.approx(plain.parameters + plain.gradients + plain.optimizer)


def test_head_stages_on_one_gpu_match_the_tracked_step():
    """``llama3_1b_2m_one_gpu.toml``'s switches (8 head stages, full_offload, a tiled MLP, FSDP CPU offload) at 128K
    tokens, two layers: on one GPU the whole sequence is the rank's, so its [T, D] terms decide a layer's backward:
    the tiled MLP's input and output gradients and the tiles beside their concatenation, the next block's input
    coming back from the host, the RoPE copies full_offload leaves on the device. Without them the estimate was
    20.6% under the tracker's layer backward here (27% at 2M tokens, the config's). Every phase the step holds
    more than 1% of its peak in: within -1% / +4%, as ``tests/test_memory_track.py``."""
    args = get_flavor("1B", n_layers=2)
    # the chunked loss, as when this was fitted: the fused loss's backward phase is 3 GiB, not 6.9, so the
    # estimate's 0.14 GiB over the tracker there (one block's prefetch and the RoPE copies, which the tracker
    # does not see at two layers; the chunked loss's phase has it too) is 4.8% of it, past this test's 4%
    switches = Switches(ac_mode="full_offload", loss_chunk_size=4096, mlp_tile_size=16384, cpu_offload=True,
                        head_stages=8, stage_keep_attention=False, loss_backend="chunked")
    tracked = track_step(args, Layout(), switches, 131072).summary()
    est = estimate(args, Layout(), switches, 131072)
    peak = max(p.peak for p in tracked.values())
    assert est.peak_phase == max(tracked, key=lambda name: tracked[name].peak)
    for name, value in est.phases.items():
        measured = tracked[name].peak
        if measured > 0.01 * peak:  # FSDP CPU offload: the optimizer step holds nothing on the device
            assert -0.01 < (value - measured) / measured < 0.04, (name, value / 2**30, measured / 2**30)
    assert tracked["layer backward"].peak > 0.9 * peak  # the phase the old terms missed is near the peak


def test_script_recommends_a_valid_layout_and_refuses_bad_input(capsys):
    estimate_memory.main(["--config", "train_configs/llama3_8b_128k.toml", "--world-size", "8",
                          "--training.seq_len", "1048576"])
    out = capsys.readouterr().out
    assert "largest seq_len fitting 90% of 80 GiB" in out
    line = [ln for ln in out.splitlines() if ln.startswith("recommended:")][0]
    degree = int(line.split("--parallelism.ulysses_degree ")[1].split()[0])
    assert degree in (1, 2, 4, 8)
    # 1M tokens of Llama-3-8B fit 8 GPUs by a larger degree: no slow FSDP CPU offload
    assert "enable_cpu_offload" not in line and "full_offload" in line, line
    with pytest.raises(SystemExit, match="seq_len 1001 is not divisible by ulysses_degree 8"):
        estimate_memory.main(["--config", "train_configs/llama3_8b_128k.toml", "--world-size", "8",
                              "--training.seq_len", "1001"])


def test_a_config_beyond_the_device_is_a_warning_naming_the_recommendation():
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.preflight import validate
    from titan_ulysses.planning.recommend import memory_warning

    config = ["--config", "train_configs/llama3_8b_128k.toml"]
    shipped = load_config(config)
    assert memory_warning(shipped, validate(shipped, 8), 8, 80 * 2**30) is None
    long = load_config(config + ["--training.seq_len", "2097152"])
    warning = memory_warning(long, validate(long, 8), 8, 80 * 2**30)
    assert "more than the device's 80.0 GiB" in warning
    assert "scripts/estimate_memory.py recommends --parallelism.ulysses_degree" in warning


def test_script_recommendation_for_flex_keeps_flex_under_cp(capsys):
    """A length that needs 32 ranks per sequence of the debug model (16 heads: ulysses 16 x cp 2) on a
    flex run: flex runs under cp (ops/attention/registry.py), so the overrides keep it, and they validate."""
    import json

    from titan_ulysses.config.manager import load_config
    from titan_ulysses.preflight import validate

    run = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "1048576", "--model.attn_backend", "flex",
           "--parallelism.ulysses_degree", "1"]
    estimate_memory.main([*run, "--world-size", "32", "--device-memory-gib", "5", "--json"])
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["ulysses_degree"] == 16 and rec["context_parallel_degree"] == 2, rec
    assert not any("attn_backend" in flag for flag in rec["overrides"]), rec
    dims = validate(load_config(run + [word for flag in rec["overrides"] for word in flag.split()]), 32)
    assert (dims.sp, dims.cp) == (16, 2)
