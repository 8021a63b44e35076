"""A mixture of experts in the step's memory: its parameters over ep and FSDP, its backward's working set.

What an MoE layer keeps for backward per token is its families' ``layer_memory``
(``models/families/moe_memory.py``); this module adds what ``estimate.py`` needs beyond that, from
``args.moe`` alone (no family names): how many of a block's parameters a rank stores and gathers (expert
weights are split over ``ep`` ranks, then sharded by FSDP over the ``n / ep`` others: ``n`` shards in all,
as the dense ones; a rank gathers only its ``E / ep`` experts), and the feed-forward's transients in backward.
Routing is counted balanced (each ep rank receives as many rows as it sends, ``planning/fake_step.py``).
docs/memory_model.md, "Mixtures of experts".
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.moe_memory import feed_forward_bytes
from titan_ulysses.planning.inputs import Layout, Switches


def _attention_params(args: DecoderArgs, d: int, q: int, kv: int) -> int:
    """An MoE block's attention and norms: the projections, their biases, sinks, q/k norms, the two norms."""
    extra = (q + 2 * kv if args.qkv_bias else 0) + (d if args.o_bias else 0) + (args.n_heads if args.attn_sinks else 0)
    return 2 * d * (q + kv) + extra + (2 * args.head_dim if args.qk_norm else 0) + 2 * d


def expert_params(args: DecoderArgs) -> int:
    """One MoE layer's experts, all of them: ``w1``, ``w3`` ``[E, D, F]``, ``w2`` ``[E, F, D]`` and biases."""
    m = args.moe
    return m.num_experts * (3 * args.dim * m.hidden_dim + (2 * m.hidden_dim + args.dim if m.expert_bias else 0))


def block_params(args: DecoderArgs, layout: Layout, d: int, q: int, kv: int, f: int) -> tuple[float, float]:
    """(one block's parameters on a tp rank, those a rank gathers to compute it), averaged over the layers.

    Dense: the decoder's count (norms, projections; no biases), both the same. MoE: attention with its
    biases, sinks and q/k norms, the router, every expert; a rank gathers ``E / ep`` experts."""
    dense = 2 * d * (q + kv) + 3 * d * f + 2 * d
    if args.moe is None:
        return float(dense), float(dense)
    m = args.moe
    attention = _attention_params(args, d, q, kv)
    router = m.num_experts * d + (m.num_experts if m.router_bias else 0)
    experts = expert_params(args)
    n_dense = len(args.moe_dense_layers)
    n_moe = args.n_layers - n_dense
    total = (n_moe * (attention + router + experts) + n_dense * (attention + 3 * d * f)) / args.n_layers
    gathered = max(attention + router + experts / layout.ep if n_moe else 0, attention + 3 * d * f if n_dense else 0)
    return total, float(gathered)


@dataclass
class ExpertUnits:
    """An MoE block's FSDP units (``distributed/fsdp.py``), in bytes: with expert parallelism the block without
    its experts (sharded over ``n``) and its experts (over ``ep_fsdp``, ``n / ep`` ranks), gathered and
    reduced at different times of the block's backward (``estimate.py``); without, one unit as a dense block."""

    dense: float
    """The block's parameters gathered in the compute dtype, its experts apart where they are a unit."""
    experts: float
    """Its ``E / ep`` experts gathered in the compute dtype (0: in the block's unit)."""
    last_gather: float
    """FSDP's all-gather buffer of the unit gathered last in a block's forward, kept until the next all-gather:
    the experts' (none where their group is one rank: nothing is gathered), or the whole block's."""
    dense_reduce: float
    """The fp32 reduce-scatter input of the block's (other) parameters' gradients."""
    experts_reduce: float
    """The fp32 reduce-scatter input of its experts' gradients (0: in the block's)."""


def expert_units(args: DecoderArgs, layout: Layout, a: int, d: int, q: int, kv: int,
                 gathered: float) -> ExpertUnits | None:
    """An MoE block's FSDP units (``gathered``: the parameters a rank gathers for it); None for a dense model."""
    if args.moe is None:
        return None
    if layout.ep == 1:
        return ExpertUnits(dense=a * gathered, experts=0.0, last_gather=a * gathered, dense_reduce=4 * gathered,
                           experts_reduce=0.0)
    experts = expert_params(args) / layout.ep
    dense = gathered - experts
    efsdp = layout.dp_shard * layout.cp * layout.sp // layout.ep
    return ExpertUnits(dense=a * dense, experts=a * experts, last_gather=a * experts if efsdp > 1 else 0.0,
                       dense_reduce=4 * dense, experts_reduce=4 * experts)


@dataclass
class FeedForwardMemory:
    """The MoE feed-forward's bytes per local token around its two peaks."""

    saved: float
    """What it keeps without AC, its input included: freed before the ffn norm's backward."""
    combine: float
    """Beyond the layer's saved tensors as its backward begins, at the weighting's backward: the output's
    gradient ``[T, D]``, its rows gathered ``[T k, D]``, the rows' gradient and their product with the rows
    (the weighted rows the scatter-add kept are freed by then)."""
    dispatch: float
    """Beyond the layer's saved tensors while its forward (or recompute) brings the experts' rows back: with
    expert parallelism, the rows sent and received (held by the calls
    that made them until they return), a zeroed ``[T k, D]`` and the received rows put back in their senders'
    order (the returned and the weighted rows, which the layer keeps, do not exist yet); or, if larger, the
    feed-forward's output and the block's new residual. gpt-oss's experts add their output bias before they
    return, holding their unbiased output, its bias rows and the clamped ``up`` ``[rows, F]`` beside it (the
    sorted-back copies come after). Without AC the top layer's is the step's forward peak. The block holds no
    attention output beside them (``models/decoder/block.py``; it did until issue 39, a ``[T, D]`` more)."""


def feed_forward_memory(args: DecoderArgs, layout: Layout, s: Switches) -> FeedForwardMemory | None:
    """The MoE feed-forward's terms; None for a dense model."""
    if args.moe is None:
        return None
    m = args.moe
    a, d, k = s.act_bytes, args.dim, m.top_k
    dispatch = 2 * a * k * d if layout.ep > 1 else 0
    if dispatch and m.expert_bias and m.activation == "clamped_swiglu":
        dispatch += a * k * m.hidden_dim
    return FeedForwardMemory(saved=a * d + feed_forward_bytes(args, layout, s, "none"), combine=a * d + 2 * a * k * d,
                             dispatch=max(dispatch, 2 * a * d))
