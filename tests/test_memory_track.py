"""The memory estimate's phases against PyTorch's memory tracker over a whole step.

``planning/track.py`` runs a steady-state step of Llama-3-8B's shape, cut to two
layers, as rank 0 of a fake world of 8 under ``FakeTensorMode`` (no compute, seconds), and
PyTorch's ``FSDPMemTracker`` gives each phase's peak. The estimate must name the same peak
phase (or one within 2% of it) and come within -1% / +4% of every phase it models: the estimate may round up, but
an under-estimate sends a user into an out-of-memory error. The sum-of-terms model this
replaced was 36%, 4% and 17% above these three peaks (it added the loss's transient to the
layers' working sets and counted gradients that a set_to_none step does not have at the
loss); a phase model that left out the root's unsharded parameters, the output weight's
gradient, the reduce-scatter buffer or the prefetched block would miss by more than 1%.
"""

import dataclasses

import pytest

from titan_ulysses.models.registry import num_params
from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning import extrapolate
from titan_ulysses.planning.track import track_step
from titan_ulysses.models.flavors import get_flavor

CASES = {
    # fitted before the fused loss (issue 47) and kept as they were: the chunked loss (loss_backend "chunked")
    # and the materialised one ("plain-loss"); the fused loss's own cases follow them
    # the shipped 8B config's switches over sp=8: the chunked loss's backward is the peak
    "full-ac-chunked-loss-sp8": (Layout(sp=8), Switches(ac_mode="full", loss_backend="chunked",
                                                             loss_chunk_size=8192), 131072,
                                 "loss backward"),
    # no AC, unchunked loss, dp_shard 2 x sp 4: the fp32 log-probabilities and their gradients
    "no-ac-plain-loss-dp2-sp4": (Layout(dp_shard=2, sp=4), Switches(loss_backend="materialized"), 32768, "loss backward"),
    # every long-context switch, cp 2 x sp 4, two microbatches: the loss's backward and a layer's are
    # within 2% of each other (the norms' fp32 temporaries are chunked, ops/norm.py)
    "selective-tiled-cp2-sp4-accum2": (
        Layout(sp=4, cp=2), Switches(ac_mode="selective", loss_backend="chunked", loss_chunk_size=1024, mlp_tile_size=4096,
                                      microbatches=2),
        262144, "loss backward"),
    # one GPU (FSDP over a world of one casts to bf16): the root's reduce-scatter in the embeddings'
    # backward, its fp32 input, output and quotient beside the output weight's bf16 gradient, is the peak
    "full-ac-one-gpu": (Layout(), Switches(ac_mode="full", loss_backend="chunked",
                                                             loss_chunk_size=8192), 32768, "embedding backward"),
    # 3 ranks: the embeddings' backward holds the same reduce-scatter with a third-size output. 32
    # heads split 11/11/10, rank 0's q heads straddle kv groups and it expands its kv heads: the
    # estimate counts the expanded and received k, v three times in the attention working set, 4.7%
    # over the layer's backward (a safe-side error, allowed below; not the peak)
    "full-ac-chunked-loss-sp3": (Layout(sp=3), Switches(ac_mode="full", loss_backend="chunked",
                                                             loss_chunk_size=8192), 3 * 16384,
                                 "loss backward"),
    # LoRA rank 16: the frozen base in bf16 without gradients or optimizer state, no output-weight or
    # embedding gradient (backward ends at block 0); the shipped 8B switches at sp=8, and no AC at dp 2 x sp 4
    "lora-full-ac-chunked-loss-sp8": (Layout(sp=8), Switches(ac_mode="full", loss_backend="chunked",
                                                                  loss_chunk_size=8192, lora_rank=16),
                                      131072, "loss backward"),
    "lora-no-ac-plain-loss-dp2-sp4": (Layout(dp_shard=2, sp=4), Switches(lora_rank=16, loss_backend="materialized"), 32768,
                                      "loss backward"),
    # head-staged attention (4 stages of one q head per rank; 8 stages in one process): each phase,
    # the layers' backward with one stage's working set among them
    "staged4-full-ac-tiled-sp8": (Layout(sp=8), Switches(ac_mode="full", loss_backend="chunked", loss_chunk_size=8192,
                                                         mlp_tile_size=8192, head_stages=4), 262144, "loss backward"),
    "staged8-full-ac-tiled-one-gpu": (Layout(), Switches(ac_mode="full", loss_backend="chunked", loss_chunk_size=8192,
                                                         mlp_tile_size=8192, head_stages=8), 65536, "embedding backward"),
    # checkpointed in a group of both layers, full_offload (planning/groups.py): the group's backward holds the lower
    # block's input and parameters beside the upper one's
    "group2-offload-staged8-tiled-one-gpu": (
        Layout(), Switches(ac_mode="full_offload", ac_layers_per_checkpoint=2, loss_backend="chunked",
                           loss_chunk_size=8192, mlp_tile_size=8192, head_stages=8), 65536, "embedding backward"),
    # the fused loss (the default, its chunk chosen from the tokens): its gradients made in forward and kept to
    # backward beside one chunk; the peak moves to a layer's backward (the chunked loss's backward held more)
    "full-ac-fused-loss-sp8": (Layout(sp=8), Switches(ac_mode="full"), 131072, "layer backward"),
    "lora-full-ac-fused-loss-sp8": (Layout(sp=8), Switches(ac_mode="full", lora_rank=16), 131072, "layer backward"),
}

OVER = {"full-ac-chunked-loss-sp3": {"layer backward": 0.05}}  # known over-estimates, per phase
UNDER: dict = {}  # known under-estimates per case and phase (none now)


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_matches_the_tracked_step(case):
    layout, switches, seq_len, peak_phase = CASES[case]
    args = get_flavor("8B", n_layers=2)
    tracked = track_step(args, layout, switches, seq_len).summary()
    est = estimate(args, layout, switches, seq_len)
    assert max(tracked, key=lambda name: tracked[name].peak) == peak_phase
    peak = max(p.peak for p in tracked.values())
    # the estimate names the peak phase, or one whose tracked peak is within 2% of it
    assert est.peak_phase == peak_phase or tracked[est.peak_phase].peak > 0.98 * peak, est.peak_phase
    for name, value in est.phases.items():
        measured = tracked[name].peak
        over = OVER.get(case, {}).get(name, 0.04)
        under = UNDER.get(case, {}).get(name, 0.01)
        assert -under < (value - measured) / measured < over, (name, value / 2**30, measured / 2**30)
    assert -0.01 < (est.total - peak) / peak < 0.04, (est.total / 2**30, peak / 2**30)


def test_offloaded_block_inputs_and_fsdp_cpu_offload_are_host_memory():
    """full_offload's block inputs and FSDP CPU offload's shards and optimizer state land on the host side."""
    args = get_flavor("debugmodel", n_layers=3, dim=256, n_heads=8, n_kv_heads=2, ffn_hidden_dim=512, vocab_size=1024)
    seq, layout = 4096, Layout(sp=2)
    full = track_step(args, layout, Switches(ac_mode="full"), seq)
    off = track_step(args, layout, Switches(ac_mode="full_offload"), seq)
    inputs = args.n_layers * 2 * args.dim * seq // layout.sp  # every block's bf16 input, [S/sp, D]
    assert full.host_peak == 0 and off.host_peak == inputs
    assert full.phases["forward"].peak - off.phases["forward"].peak >= inputs - 2 * args.dim * seq // layout.sp
    cpu = track_step(args, layout, Switches(ac_mode="full", cpu_offload=True), seq)
    states = 16 * num_params(args) // layout.sp  # fp32 parameters, gradients and two AdamW states, sharded
    assert abs(cpu.host_peak - states) < 0.01 * states, (cpu.host_peak, states)
    assert cpu.phases["optimizer step"].peak < 0.01 * full.phases["optimizer step"].peak


def _small_8b(n_layers):
    """Llama-3-8B's structure, small (fake tensors cost no memory, only ops: the dims keep every block input
    above the offloader's 1 MiB at the samples)."""
    return get_flavor("8B", n_layers=n_layers, dim=1024, n_heads=8, n_kv_heads=2, ffn_hidden_dim=2048, vocab_size=4096)


@pytest.fixture
def small_chunks(monkeypatch):
    """The norm, the MLP and the loss in chunks of 256 tokens: a token quantum of 256 (few ops)."""
    from titan_ulysses.ops import norm

    monkeypatch.setattr(norm, "CHUNK_TOKENS", 256)
    monkeypatch.setattr(extrapolate, "MIN_QUANTA", 6)  # extrapolate from 6 quanta on (not only from 32)
    return Switches(ac_mode="full_offload", loss_chunk_size=256, mlp_tile_size=256)


def test_layer_and_token_extrapolation_is_exact(small_chunks):
    """Traced at 3 and 4 layers x 3 and 4 token quanta (checked at 5) and extrapolated to 5 layers x 6
    quanta, every phase, its kinds and the host peak equal the step traced at 5 layers x 6 quanta, to the byte.
    (Layer backward is extrapolated as its two lowest and two highest blocks: the phases both have.)"""
    args, layout, seq = _small_8b(5), Layout(sp=2), 2 * 6 * 256
    fast = track_step(args, layout, small_chunks, seq)
    direct = track_step(args, layout, small_chunks, seq, extrapolate=False)
    assert "3 and 4 layers x 1,536 and 2,048 tokens (on the line at 2,560)" in fast.traced, fast.traced
    assert direct.traced == "traced at 5 layers x 3,072 tokens"
    shared = [n for n in direct.phases if n in fast.phases]
    assert len(shared) == len(fast.phases) and "loss backward" in shared
    assert [(fast.phases[n].peak, fast.phases[n].kinds) for n in shared] == \
        [(direct.phases[n].peak, direct.phases[n].kinds) for n in shared]
    assert (fast.peak, fast.host_peak) == (direct.peak, direct.host_peak) and fast.host_peak > 0


def test_off_the_line_is_traced_at_full_length(small_chunks, monkeypatch):
    """Head-staged samples are on their lines, and an event one byte off is found; where the samples are not
    affine (forced here), the step is traced at its full length and says so."""
    import dataclasses

    ex = extrapolate
    args, layout, seq = _small_8b(2), Layout(sp=2), 2 * 6 * 256
    switches = dataclasses.replace(small_chunks, head_stages=2)
    check, seen = ex.off_the_line, []

    def forced(a, b, c=None):
        seen.append(check(a, b, c))
        phase = "layer 0 backward"
        key = max(c.events[phase], key=lambda k: c.events[phase][k][0])
        c.events[phase][key][0] += 1
        seen.append(check(a, b, c))
        return "forced by the test"

    monkeypatch.setattr(ex, "off_the_line", forced)
    fallback = track_step(args, layout, switches, seq)
    assert seen[0] == "" and seen[1].startswith("layer 0 backward: "), seen
    direct = track_step(args, layout, switches, seq, extrapolate=False)
    assert fallback.traced == "traced at 2 layers x 3,072 tokens (not extrapolated in tokens: forced by the test)"
    assert dataclasses.replace(fallback, traced="") == dataclasses.replace(direct, traced="")


def test_clipping_holds_no_global_shapes():
    """At world 8 the clipping phase holds the sharded parameters, gradients and optimizer state and nothing
    else: DTensor's sharding propagation, which runs ops on fake tensors of the global (unsharded) shapes to
    learn their outputs' shapes, is not counted (it was: every parameter full-size in fp32)."""
    args = get_flavor("debugmodel", n_layers=2, dim=256, n_heads=8, n_kv_heads=8, ffn_hidden_dim=512, vocab_size=1024)
    step = track_step(args, Layout(sp=8), Switches(ac_mode="full", loss_chunk_size=256), 4096)
    clip = step.phases["clip grad norm"].kinds
    shard = 4 * num_params(args) / 8  # fp32, a world of 8
    assert abs(clip["Sharded Param"] - shard) < 0.01 * shard and clip["Sharded Grad"] == clip["Sharded Param"]
    assert 0 <= clip["OptState"] - 2 * clip["Sharded Param"] < 1024  # AdamW's two states and its step counters
    # what else is there: the token inputs and the norms' fp32 scalars
    rest = sum(v for k, v in clip.items() if k not in ("Sharded Param", "Sharded Grad", "OptState", "Inputs"))
    assert rest < 4096, clip


def test_groups_extrapolate_in_groups():
    """Checkpointed in groups of 2 (full_offload), 9 layers are traced at 5 and 7 (three and four groups, the last
    of one layer as at 9) and extrapolated: every phase, its kinds and the host peak equal the step traced at 9."""
    args = get_flavor("debugmodel", n_layers=9, dim=256, n_heads=8, n_kv_heads=2, ffn_hidden_dim=512, vocab_size=1024)
    switches, seq = Switches(ac_mode="full_offload", ac_layers_per_checkpoint=2, loss_chunk_size=1024), 4096
    fast = track_step(args, Layout(), switches, seq)
    direct = track_step(args, Layout(), switches, seq, extrapolate=False)
    assert fast.traced.startswith("traced at 5 and 7 layers (3 and 4 groups of 2, the last of 1) x"), fast.traced
    assert direct.traced == "traced at 9 layers x 4,096 tokens"
    layers = [f"layer {i} backward" for i in (8, 7, 6, 3, 2, 1, 0)]  # the two lowest and the two highest groups
    assert [n for n in fast.phases if n.startswith("layer ")] == layers
    assert {n: (p.peak, p.kinds) for n, p in fast.phases.items()} == \
        {n: (direct.phases[n].peak, direct.phases[n].kinds) for n in fast.phases}
    assert (fast.peak, fast.host_peak) == (direct.peak, direct.host_peak) and fast.host_peak == 5 * 2 * 256 * seq


def test_groups_hold_what_the_estimate_adds():
    """Checkpointed in groups of 2 under full_offload with FSDP CPU offload, against k = 1: the host keeps one block
    input per group instead of one per block, and the device peak (the top group's backward) holds k - 1 block
    inputs more (and, in the tracker, the RoPE tables' size and k - 1 blocks' unsharded parameters: small here).
    The estimate's host peak is the tracker's (to its optimizer's step counters), and what it adds for the groups
    to the loss's and the layers' backward is what the tracker adds, to the byte (``planning/groups.py``)."""
    import math

    n, k, seq = 4, 2, 16384
    args = get_flavor("debugmodel", n_layers=n, dim=128, n_heads=8, n_kv_heads=2, ffn_hidden_dim=128, vocab_size=256)
    block_input = seq * args.dim * 2  # bf16 [1, S, D]
    switches = {kk: Switches(ac_mode="full_offload", ac_layers_per_checkpoint=kk, loss_chunk_size=4096,
                             cpu_offload=True) for kk in (1, k)}
    steps = {kk: track_step(args, Layout(), sw, seq, extrapolate=False) for kk, sw in switches.items()}
    est = {kk: estimate(args, Layout(), sw, seq) for kk, sw in switches.items()}
    assert steps[1].host_peak - steps[k].host_peak == (n - math.ceil(n / k)) * block_input
    for kk in (1, k):
        assert 0 <= steps[kk].host_peak - est[kk].host_offloaded < 1024, (steps[kk].host_peak, est[kk].host_offloaded)
    grown = steps[k].peak - steps[1].peak
    assert (k - 1) * block_input <= grown <= (k - 0.5) * block_input, grown / block_input
    tracked = {kk: step.summary() for kk, step in steps.items()}
    for phase in ("loss backward", "layer backward"):
        assert est[k].phases[phase] - est[1].phases[phase] == tracked[k][phase].peak - tracked[1][phase].peak > 0


@pytest.mark.parametrize("model_type, mode", [("qwen3", "none"), ("gemma3_text", "none"), ("gemma3_text", "selective"),
                                              ("gemma3_text", "full")])
def test_a_family_layer_terms_are_what_the_tracker_adds(model_type, mode):
    """A family's own per-layer terms (``ModelFamily.layer_memory``: Qwen3's and Gemma 3's per-head q/k norms,
    Gemma's sandwich norms and the checkpoint's copy of its sliding layers' RoPE) add, over the Llama decoder of
    the same shape, what the tracker adds: to 0.5 MiB in the loss's backward, which holds every layer's saved
    tensors. A layer's backward differs by its extra norms' working sets (not modelled: within 5%)."""
    from titan_ulysses.interop.hf_config import args_from_hf_config

    cfg = {"model_type": model_type, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 3,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 4096,
           "tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": 65536}
    if model_type == "gemma3_text":  # no window: the CPU kernels would build [S, S] masks the GPU ones do not
        cfg.update(sliding_window=None, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=128, rope_local_base_freq=10000.0)
    args = args_from_hf_config(cfg)
    twin = dataclasses.replace(args, family="llama", qk_norm=False, layer_types=[], local_rope_theta=0.0,
                               query_pre_attn_scalar=0.0)
    layout, switches, seq = Layout(sp=2), Switches(ac_mode=mode, loss_chunk_size=1024), 16384
    est = {a.family: estimate(a, layout, switches, seq).phases for a in (args, twin)}
    tracked = {a.family: track_step(a, layout, switches, seq, extrapolate=False).summary() for a in (args, twin)}
    added = est[model_type]["loss backward"] - est["llama"]["loss backward"]
    measured = tracked[model_type]["loss backward"].peak - tracked["llama"]["loss backward"].peak
    assert measured > 2**20 and abs(added - measured) < 2**19, (added / 2**20, measured / 2**20)
    for name, value in est[model_type].items():
        assert abs(value - tracked[model_type][name].peak) < 0.05 * tracked[model_type][name].peak, name
