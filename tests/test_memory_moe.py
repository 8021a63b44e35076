"""A mixture of experts in the memory estimate, against the tracker's step (``planning/moe_terms.py``,
``models/families/moe_memory.py``).

Tiny Qwen3-MoE and gpt-oss (sinks off: on sdpa they run unfused, quadratic attention the estimate does not
model) at sp = 2 with ep = 2 -- the layout of train_configs/qwen3_30b_a3b_1m.toml, whose experts' FSDP group is
one rank -- and at dp_shard 2 x sp 2 with ep = 2 (a group of two). Each phase the MoE terms decide is the
tracker's to 48 bytes per local token either way (the step's token, label and position inputs, which the
estimate leaves out, and the routing mask a dropped statistics branch frees) and 32 KiB, at two lengths: the
per-token terms and the parameters' are each right, not only their sum. Left out, a term falls outside: the
router's fp32 probabilities (32 B per token and layer here), one [rows, F] intermediate, the combine's [T, D]
gradient. The norm and the loss run in chunks of 256 tokens, so both lengths are whole chunks (at shorter ones
the top block's gathers, which the tracker counts in the loss's backward, outgrow the loss's chunks).
"""

import dataclasses
import json
import os

import pytest

from titan_ulysses.interop.hf_config import args_from_hf_config
from titan_ulysses.planning import extrapolate
from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import GIB, Layout, Switches
from titan_ulysses.planning.track import track_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB = 1024


def tiny(model_type: str, n_layers: int = 2):
    """8 experts of 512, top-2, dim 1024, 8 q heads and 2 kv heads of 128."""
    cfg = {"model_type": model_type, "hidden_size": 1024, "intermediate_size": 512, "num_hidden_layers": n_layers,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 4096,
           "tie_word_embeddings": False, "rope_theta": 1e6, "max_position_embeddings": 65536, "num_experts": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512, "norm_topk_prob": True}
    if model_type == "gpt_oss":
        cfg.update(sliding_window=None, layer_types=["full_attention"] * n_layers)
        return dataclasses.replace(args_from_hf_config(cfg), attn_sinks=False)
    return args_from_hf_config(cfg)


@pytest.fixture
def small_chunks(monkeypatch):
    """The norm and the loss in chunks of 256 tokens (few ops; every traced length a whole number of chunks)."""
    from titan_ulysses.ops import norm
    from titan_ulysses.planning import estimate as estimate_module

    monkeypatch.setattr(norm, "CHUNK_TOKENS", 256)
    monkeypatch.setattr(estimate_module, "NORM_CHUNK_TOKENS", 256)
    monkeypatch.setattr(extrapolate, "MIN_QUANTA", 6)


CASES = {
    "qwen3_moe-none-sp2-ep2": ("qwen3_moe", Layout(sp=2, ep=2), {"ac_mode": "none"}),
    "qwen3_moe-offload-staged-sp2-ep2": ("qwen3_moe", Layout(sp=2, ep=2), {
        "ac_mode": "full_offload", "head_stages": 2, "stage_keep_attention": False}),
    "qwen3_moe-full-dp2-sp2-ep2": ("qwen3_moe", Layout(dp_shard=2, sp=2, ep=2), {"ac_mode": "full"}),
    # without expert parallelism the experts are in the block's FSDP unit; selective AC (with ep > 1 it stops in
    # the recompute: the experts' own FSDP unit inside a selectively checkpointed block, docs/memory_model.md)
    # (the chunked loss: under the fused loss, whose backward only scales, this case's loss backward is estimated
    # 2.3% under the tracker, past the -1% the dense terms allow; the MoE term it lacks is not modelled yet, 2026-11-28)
    "qwen3_moe-selective-sp2": ("qwen3_moe", Layout(sp=2), {"ac_mode": "selective", "loss_backend": "chunked"}),
    "gpt_oss-none-sp2-ep2": ("gpt_oss", Layout(sp=2, ep=2), {"ac_mode": "none"}),
    "gpt_oss-offload-dp2-sp2-ep2": ("gpt_oss", Layout(dp_shard=2, sp=2, ep=2), {"ac_mode": "full_offload"}),
}
EXACT = ("forward", "loss forward", "layer backward", "optimizer step")
"""The phases whose MoE terms are exact; the loss's backward and the embeddings' keep the dense model's terms
(within -1% / +4%, as tests/test_memory_track.py allows them)."""
SEQS = (12288, 16384)
_TRACKED: dict = {}


def tracked(case: str, seq: int):
    """The tracker's step of ``case`` at ``seq`` tokens, traced once per session (the tests below share it)."""
    if (case, seq) not in _TRACKED:
        model_type, layout, switches = CASES[case]
        _TRACKED[case, seq] = track_step(tiny(model_type), layout, Switches(loss_chunk_size=256, **switches), seq,
                                         extrapolate=False)
    return _TRACKED[case, seq]


def off_phases(case: str, seq: int) -> list:
    """The estimate's phases (and total) outside the tolerance of the tracker's, with their error per token."""
    model_type, layout, switches = CASES[case]
    tokens, step = seq // layout.sp, tracked(case, seq)
    phases = step.summary()
    est = estimate(tiny(model_type), layout, Switches(loss_chunk_size=256, **switches), seq)
    off = []
    for name, value in [*est.phases.items(), ("total", est.total)]:
        measured = step.peak if name == "total" else phases[name].peak
        if name in EXACT or name == "total":
            if abs(value - measured) > 48 * tokens + 32 * KIB:
                off.append((name, (value - measured) / tokens))
        elif not -0.01 < (value - measured) / measured < 0.04:
            off.append((name, value / measured))
    return off


@pytest.mark.parametrize("case", list(CASES))
def test_moe_phases_are_the_trackers(case, small_chunks):
    model_type, layout, switches = CASES[case]
    sw = Switches(loss_chunk_size=256, **switches)
    for seq in SEQS:
        assert off_phases(case, seq) == [], seq
        est, phases = estimate(tiny(model_type), layout, sw, seq), tracked(case, seq).summary()
        assert ("forward" in est.phases) == (sw.ac_mode == "none")  # the dispatch's forward peak, without AC
        kinds = phases["optimizer step"].kinds  # the states: expert weights over ep, then FSDP over n / ep
        assert abs(est.parameters - kinds["Sharded Param"]) < KIB and abs(est.optimizer - kinds["OptState"]) < KIB


def _drop_router_probabilities(monkeypatch):
    from titan_ulysses.models.families import moe_memory

    full = moe_memory.router_bytes
    monkeypatch.setattr(moe_memory, "router_bytes", lambda args, a: full(args, a) - 4 * args.moe.num_experts)


def _drop_a_row_intermediate(monkeypatch):
    from titan_ulysses.models.families import moe_memory

    full = moe_memory.activation_rows
    monkeypatch.setattr(moe_memory, "activation_rows", lambda args: full(args) - 1)


def _drop_the_combines_gradient(monkeypatch):
    from titan_ulysses.planning import estimate as estimate_module

    full = estimate_module.feed_forward_memory

    def fewer(args, layout, s):
        m = full(args, layout, s)
        return dataclasses.replace(m, combine=m.combine - s.act_bytes * args.dim)

    monkeypatch.setattr(estimate_module, "feed_forward_memory", fewer)


@pytest.mark.parametrize("drop, case", [
    (_drop_router_probabilities, "qwen3_moe-none-sp2-ep2"),  # 32 B per token and layer, the smallest checked
    (_drop_a_row_intermediate, "qwen3_moe-full-dp2-sp2-ep2"),  # in the recompute
    (_drop_the_combines_gradient, "qwen3_moe-none-sp2-ep2"),  # a [T, D] of the backward's working set
], ids=lambda v: getattr(v, "__name__", v))
def test_the_tolerance_catches_a_missing_term(drop, case, small_chunks, monkeypatch):
    """The check above fails with one of the MoE terms left out (the tracker's step is the same)."""
    drop(monkeypatch)
    assert off_phases(case, SEQS[0]), f"{drop.__name__} went unnoticed"


def test_moe_extrapolates_exactly(small_chunks):
    """Traced at 3 and 4 layers x 3 and 4 token quanta and extrapolated to 5 layers x 6 quanta, every phase, its kinds
    and the host peak equal the step traced whole, to the byte: the dispatch's terms are affine too."""
    args, layout = tiny("qwen3_moe", 5), Layout(sp=2, ep=2)
    sw = Switches(ac_mode="full_offload", loss_chunk_size=256)
    fast = track_step(args, layout, sw, 2 * 6 * 256)
    direct = track_step(args, layout, sw, 2 * 6 * 256, extrapolate=False)
    assert "3 and 4 layers x 1,536 and 2,048 tokens (on the line at 2,560)" in fast.traced, fast.traced
    assert {n: (p.peak, p.kinds) for n, p in fast.phases.items()} == \
        {n: (direct.phases[n].peak, direct.phases[n].kinds) for n in fast.phases}
    assert (fast.peak, fast.host_peak) == (direct.peak, direct.host_peak) and fast.host_peak > 0


def test_the_tracker_assumes_balanced_routing():
    """Fake tensors have no routing: the dispatch's host sync splits a rank's rows evenly over the ep ranks and
    the experts (the larger parts first), and the step's record says so. Outside the tracker the counts decide."""
    import torch

    from titan_ulysses.distributed.expert_parallel import ExpertParallel
    from titan_ulysses.planning.fake_step import balanced_experts

    send, recv = torch.tensor([[3, 0], [1, 1]]), torch.tensor([[2, 2], [0, 1]])
    assert ExpertParallel.split_sizes(send, recv, 5) == ([3, 2], [4, 1])
    with balanced_experts():
        assert ExpertParallel.split_sizes(send, recv, 5) == ([3, 2], [3, 2])
    step = track_step(tiny("qwen3_moe"), Layout(sp=2, ep=2), Switches(ac_mode="full", loss_chunk_size=1024), 4096,
                      extrapolate=False)
    assert "routing assumed balanced: each of the 8 experts gets T x 2 / 8 of a rank's rows, each of the 2 ep " \
           "ranks receives as many as it sends" in step.traced, step.traced


CONFIG = os.path.join(ROOT, "train_configs", "qwen3_30b_a3b_1m.toml")


def test_qwen3_30b_a3b_1m_fits_its_budgets(capsys):
    """The shipped 1M-token Qwen3-30B-A3B config (8 H100): its estimate within 72 GiB of device memory and 200 GiB
    of host memory per rank, from the config.json shipped in assets/ alone. The estimate only: ``--track`` of this
    config traces 1M tokens whole (16 token quanta per rank, too few to extrapolate), 2.7 CPU-minutes; its figures
    and command are in docs/benchmarks.md."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import estimate_memory

    assert estimate_memory.main(["--config", CONFIG, "--world-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == {"dp_shard": 1, "sp": 8, "tp": 1, "cp": 1, "ep": 8} and out["seq_len"] >= 2**20
    assert out["bytes"]["total"] <= 72 * GIB and out["bytes"]["host_offloaded"] <= 200 * GIB, out["bytes"]


def test_the_dry_run_names_the_experts(capsys, tmp_path):
    """``train.py --dry-run`` of the shipped config (a byte tokenizer and synthetic data for the files it names)
    says how the experts are laid out, that routing is counted balanced, and the host memory, as estimated."""
    import sys

    sys.path.insert(0, ROOT)
    import train

    with open(os.path.join(ROOT, "assets", "hf", "Qwen3-30B-A3B", "config.json")) as f:
        hf = json.load(f)
    code = train.main(["--config", CONFIG, "--model.hf_assets_path", os.path.join(ROOT, "assets/hf/Qwen3-30B-A3B"),
                       "--model.tokenizer", "byte", "--training.dataset", "passkey",
                       "--job.dump_folder", str(tmp_path / "run"), "--dry-run", "--world-size", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    e, k = hf["num_experts"], hf["num_experts_per_tok"]
    assert f"{e} experts over ep 8 ({e // 8} per rank), top-{k}" in out, out
    assert "experts' routing counted balanced" in out and "host memory per rank (estimate): " in out, out
    assert f"{hf['num_hidden_layers']} layers, dim {hf['hidden_size']}" in out, out
