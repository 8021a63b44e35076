"""What a mixture-of-experts layer keeps for backward per local token: the MoE families' ``layer_memory``.

The decoder's terms (``planning/layer_terms.py``) with the feed-forward's replaced by the router's, the
dispatch's and the experts' (``models/moe/``), read off their ops; each checked to the byte against the
memory tracker (tests/test_memory_track.py). Routing is counted balanced: each token's ``k`` rows, and with
expert parallelism as many rows received as sent. docs/memory_model.md, "Mixtures of experts".
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs

INDEX = 8
"""Bytes of an int64 index (top-k's experts, the sort's order, each row's token)."""


def router_bytes(args: DecoderArgs, a: int) -> float:
    """The router's saved tensors per token: softmax_topk keeps the fp32 probabilities ``[T, E]``, the top-k
    indices and (``norm_topk_prob``) the top-k values and their sum; topk_softmax the probabilities (for the
    load-balancing statistics), the indices and the softmax over the top k; both the [T] mask of counted tokens."""
    m = args.moe
    kept = 4 * m.num_experts + INDEX * m.top_k + 4
    if m.router == "topk_softmax":
        return kept + a * m.top_k
    return kept + (4 * m.top_k + 4 if m.norm_topk_prob else 0)


def activation_rows(args: DecoderArgs) -> int:
    """``[rows, F]`` tensors the experts keep per row: SwiGLU its gate and up products, the SiLU and the product;
    gpt-oss's clamped SwiGLU the two clamps' inputs, the clamped gate, ``up + 1``, the sigmoid, the gated
    product and the product."""
    return 7 if args.moe.activation == "clamped_swiglu" else 4


def dispatch_bytes(args: DecoderArgs, a: int, ep: int) -> float:
    """Per token, the rows' saved tensors: the sort's order and each row's token (int64), the routing weight of
    each row, the experts' input rows, their ``[rows, F]`` intermediates, their output (which the weighting
    keeps) and the weighted rows (which the scatter-add back keeps); with biases each row's expert (int64);
    with expert parallelism also the received rows' order and the experts' output before its return."""
    m = args.moe
    d, k, f = args.dim, m.top_k, m.hidden_dim
    row = 2 * INDEX + a + 3 * a * d + activation_rows(args) * a * f + (INDEX if m.expert_bias else 0)
    if ep > 1:
        row += INDEX + a * d
    return k * row


def selective_bytes(args: DecoderArgs, a: int, ep: int) -> float:
    """What selective AC's policy (matmuls and all-to-alls) keeps of the feed-forward per token: the router's
    logits (``aten.mm``; with a bias the router is an addmm, recomputed) and, with expert parallelism, both
    all-to-alls' rows. The grouped products are recomputed."""
    m = args.moe
    router = 0 if m.router_bias else a * m.num_experts
    return router + (2 * a * args.dim * m.top_k if ep > 1 else 0)


def feed_forward_bytes(args: DecoderArgs, layout, switches, mode: str) -> float:
    """The MoE feed-forward's own bytes per local token under AC ``mode`` (its input, the ffn norm's output, is
    the decoder's)."""
    a, ep = switches.act_bytes, getattr(layout, "ep", 1)
    if mode == "none":
        return router_bytes(args, a) + dispatch_bytes(args, a, ep)
    if mode == "selective":
        return selective_bytes(args, a, ep)
    return 0.0


def moe_layer_memory(decoder_terms, args: DecoderArgs, layout, switches, mode: str) -> float:
    """``ModelFamily.layer_memory`` of the MoE families: the decoder's terms without its dense MLP, and the
    MoE feed-forward's; layers that keep the dense MLP (``args.moe_dense_layers``) as the decoder counts them,
    the average over the layers (the phases sum them). Experts are never tiled."""
    if args.moe is None:
        return decoder_terms(args, layout, switches, mode)
    untiled = dataclasses.replace(switches, mlp_tile_size=0)
    no_mlp = decoder_terms(dataclasses.replace(args, ffn_hidden_dim=0), layout, untiled, mode)
    if mode == "selective":  # the decoder's selective terms keep the dense MLP's w2 output: an MoE has none
        no_mlp -= switches.act_bytes * args.dim
    moe = no_mlp + feed_forward_bytes(args, layout, switches, mode)
    dense = len(args.moe_dense_layers)
    if not dense:
        return moe
    per_dense = decoder_terms(args, layout, switches, mode)
    return (moe * (args.n_layers - dense) + per_dense * dense) / args.n_layers
