"""What one layer keeps for backward per local token, and the attention widths behind it.

The attended widths of the busiest sp rank (uneven head splits, expanded kv heads), cp's K/V prefixes, the
head stages' terms and ``layer_bytes_per_token`` under each activation checkpointing mode: the terms
``estimate.py`` sums into the step's phases. Derived in docs/memory_model.md, "What a layer keeps".
"""

from __future__ import annotations

from titan_ulysses.distributed.heads import attended_heads
from titan_ulysses.distributed.staged_attention import stage_plans
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.models.decoder.args import DecoderArgs


def widths(args: DecoderArgs, layout: Layout, fp32: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """(D, q, kv, the attended widths qa, kva_held, kva, F) per local token.

    q, kv: the projections' widths on a tp rank. qa, kva: the q and kv widths the busiest sp
    rank attends with over the whole sequence, per local token (``heads x sp x Dh``; even
    splits: q and r kv); kva_held adds the received kv heads where a rank expands them, as
    in ``fp32`` without cp, where CUDA's sdpa kernels other than flash need a kv head per q
    head (``ops/attention.py``): attention keeps the expanded copies, and under Ulysses the
    all-to-all's buffer they were cut from, which holds q too.
    """
    q = args.n_heads * args.head_dim // layout.tp
    kv = args.n_kv_heads * args.head_dim // layout.tp
    n_q, n_kv_in, n_kv = attended_heads(args.n_heads // layout.tp, args.n_kv_heads // layout.tp, layout.sp)
    per_head = layout.sp * args.head_dim
    held = n_kv + (n_kv_in if n_kv != n_kv_in else 0)
    if fp32 and layout.cp == 1 and n_kv != n_q:  # after Ulysses the received k, v share q's kept buffer
        held = n_q + (held if layout.sp > 1 else 0)
    return args.dim, q, kv, n_q * per_head, held * per_head, n_kv * per_head, args.ffn_hidden_dim // layout.tp


def cp_kv_per_token(args: DecoderArgs, layout: Layout, s: Switches) -> float:
    """Bytes per local token of the K/V prefixes a cp rank's two chunks attend to: ``(2cp + 1) / 2cp`` of the
    sequence together (docs/memory_model.md)."""
    _, _, _, qa, _, kva, _ = widths(args, layout)
    width = kva if s.act_bytes == 2 else qa  # bf16: flash takes GQA; fp32: expanded to the q heads
    return s.act_bytes * width * (2 * layout.cp + 1)


def stage_kept_per_token(args: DecoderArgs, layout: Layout, s: Switches) -> float:
    """Head stages that keep their attention kernel's outputs (``Switches.stage_keep_attention``): every stage's
    output and fp32 logsumexp, per local token (the busiest rank's heads; 0 without stages or keep)."""
    if s.head_stages <= 1 or not s.stage_keep_attention:
        return 0.0
    _, _, _, qa, _, _, _ = widths(args, layout)
    return s.act_bytes * qa + 4 * (qa // args.head_dim)


def _stage_terms(args: DecoderArgs, layout: Layout, s: Switches) -> list[dict[str, float]]:
    """Per head stage, bytes per local token of the busiest rank: its projections' outputs before the exchange
    (``local``), the all-to-all's buffer (``exchanged``; the received kv heads expanded where a rank needs them),
    the kernel's output and fp32 logsumexp (``kernel``), the returned output (``returned``, sp > 1) and its
    projection's share of the layer output (``share``)."""
    a, dh = s.act_bytes, args.head_dim
    plans = stage_plans(args.n_heads // layout.tp, args.n_kv_heads // layout.tp, layout.sp, s.head_stages)
    terms = []
    for plan in plans:
        nq = sum(b - e for e, b in plan.q)
        nkv = sum(b - e for e, b in plan.kv)
        busiest = max(range(layout.sp), key=lambda r: plan.q[r][1] - plan.q[r][0])
        hq = (plan.q[busiest][1] - plan.q[busiest][0]) * layout.sp
        hkv = (plan.kv[busiest][1] - plan.kv[busiest][0]) * layout.sp
        expand = plan.kv_index(busiest) is not None or (a == 4 and hq != hkv)
        hkv_held = hkv + (hq if expand else 0)
        terms.append({"local": a * (nq + 2 * nkv) * dh, "exchanged": a * (hq + 2 * hkv_held) * dh,
                      "kernel": a * hq * dh + 4 * hq, "returned": a * nq * dh if layout.sp > 1 else 0,
                      "share": a * args.dim, "rope": max(nq, nkv) * dh})
    return terms


def stage_bytes_per_token(args: DecoderArgs, layout: Layout, s: Switches) -> tuple[float, float]:
    """Head-staged attention (``distributed/staged_attention.py``) per local token, beyond the layer's recompute:
    (the largest stage's forward inside the layer's recompute, its backward). Forward: the stages' sum so far and
    the last stage's share of the layer output (the residual and the ffn_norm's output do not exist yet, the
    output's gradient does) beside the stage's projections and RoPE's fp32 temporaries (an upcast, two products,
    their difference and sum, the output: ``12 + a`` bytes per element of the wider of q and k). Backward: the
    kernel's saved q/k/v and output and their gradients beside the returned output's, or the stage's gradient of
    the norm's output and its sum with the earlier stages' beside two projections' gradients."""
    a = s.act_bytes
    fwd, bwd = 0.0, 0.0
    for t in _stage_terms(args, layout, s):
        fwd = max(fwd, t["share"] + t["local"] + ((12 if a < 4 else 8) + a) * t["rope"])
        saved = 0.0 if s.stage_keep_attention else t["kernel"]  # kept: counted with every stage's
        bwd = max(bwd, 2 * t["exchanged"] + saved + t["kernel"] + t["returned"], 2 * t["share"] + t["local"])
    return fwd, bwd


def stage_selective_per_token(args: DecoderArgs, layout: Layout, s: Switches) -> float:
    """What selective AC's cache keeps of a head-staged layer per local token: its policy sees the ops inside every
    stage's checkpoint, so it keeps each stage's matmul, all-to-all and kernel outputs (keep or not)."""
    sp = layout.sp > 1
    return sum(t["local"] + (t["exchanged"] if sp else 0) + t["kernel"] + t["returned"] + t["share"]
               for t in _stage_terms(args, layout, s))


def layer_bytes_per_token(args: DecoderArgs, layout: Layout, s: Switches, mode: str = "none") -> float:
    """Bytes one layer keeps for backward per local token under AC ``mode``."""
    d, q, kv, qa, kva_held, kva, f = widths(args, layout, s.act_bytes == 4)
    a = s.act_bytes
    heads = qa // args.head_dim  # busiest rank's q heads x sp
    attention = a * (qa + 2 * kva_held) + a * qa + 4 * heads
    # the output projection's input: its own buffer after the return all-to-all; without
    # Ulysses a view of the attention output (kernels write it [B, S, H, Dh]), counted above
    wo_input = a * q if layout.sp > 1 else 0
    if s.head_stages > 1:  # each stage keeps only its input (the norm's output, counted below) past its backward,
        # and with keep its kernel's outputs: from forward without AC and in selective AC's cache; a recompute-all
        # mode's layer recompute holds them in its backward instead (the full set's, below)
        attention = stage_kept_per_token(args, layout, s) if mode in ("none", "selective") else 0.0
        wo_input = 0
    if layout.cp > 1:  # selective AC keeps the all-gather's output and recomputes the prefixes cut from it
        attention += a * 2 * layout.cp * kva if mode == "selective" else cp_kv_per_token(args, layout, s)
    rope = a * args.head_dim if a < 4 else 0  # the block's bf16 cos and sin, [T, Dh/2] each
    if mode in ("full", "full_offload"):  # full_offload: the input goes to the host; the RoPE tuple stays
        return a * d + rope if mode == "full" else float(rope)
    if mode == "selective" and s.head_stages > 1:  # every stage's saved outputs, the tiled or untiled MLP's as below
        mlp = 0 if s.mlp_tile_size else 2 * a * f + a * d
        cp = attention - stage_kept_per_token(args, layout, s)
        return stage_selective_per_token(args, layout, s) + cp + mlp + a * d + rope
    if mode == "selective":
        # the MLP's matmul outputs (w1, w3, w2), untiled; tiled, nothing (its input is recomputed too)
        mlp = 0 if s.mlp_tile_size else 2 * a * f + a * d
        qkv = 0 if s.head_stages > 1 else a * (q + 2 * kv)  # staged: the projections run inside each stage
        return qkv + a * d + mlp + attention + wo_input + a * d + rope
    mlp = a * d + (0 if s.mlp_tile_size else 4 * a * f)
    norms = 2 * (a * d + 4)
    return norms + a * d + attention + wo_input + mlp + rope


def family_layer_bytes(args: DecoderArgs, layout: Layout, s: Switches, mode: str = "none") -> float:
    """Bytes one layer keeps for backward per local token, as the model's family counts them
    (``ModelFamily.layer_memory``, given :func:`layer_bytes_per_token`); by default the decoder's, that function's."""
    from titan_ulysses.models.registry import get_family

    own = get_family(args.family).layer_memory
    return own(layer_bytes_per_token, args, layout, s, mode) if own else layer_bytes_per_token(args, layout, s, mode)
