"""Per-device memory of a training step, from the config alone (pure arithmetic).

``estimate`` adds up the terms each phase of a steady-state step holds together (``Estimate.phases``) and
takes the largest phase as the peak: a plain sum of every term would count transients that never live
together. What one layer keeps per local token is ``layer_terms.py``'s, checkpoint groups' terms
``groups.py``'s. The derivation, the notation of the comments below (T, a, D, q, kv, r, F, V) and where
the model is known to be off: docs/memory_model.md. Each phase is checked against the CPU tracker
(``track.py``; ``tests/test_memory_track.py``, ``scripts/estimate_memory.py --track``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from titan_ulysses.planning import groups
from titan_ulysses.planning.moe_terms import block_params, expert_units, feed_forward_memory
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.layer_terms import (
    cp_kv_per_token,
    family_layer_bytes,
    layer_bytes_per_token,
    stage_bytes_per_token,
    stage_kept_per_token,
    widths,
)
from titan_ulysses.ops.loss.common import chunk_rows
from titan_ulysses.ops.norm import CHUNK_TOKENS as NORM_CHUNK_TOKENS
from titan_ulysses.models.decoder.args import DecoderArgs


@dataclass
class Estimate:
    """Bytes per device. Each field is one term at its peak; ``phases`` adds up the terms alive
    together in each phase of the step, and ``total`` is the largest phase."""

    parameters: float
    gradients: float
    optimizer: float
    unsharded_working_params: float
    """FSDP's compute-dtype copies during a layer's backward: the root's parameters, this block's
    parameters and gradients and the next block's all-gather buffer."""
    saved_activations: float
    layer_recompute: float
    attention_working_set: float
    mlp_working_set: float
    logits: float
    """The loss's largest transient over tokens x vocabulary (one chunk with the fused and chunked backends)."""
    host_offloaded: float
    """Bytes moved to host memory (not in ``total``)."""
    loss_weight_gradient: float = 0.0
    """The fp32 [V, D] output-weight gradient and the hidden states' gradient beside the loss's backward (the
    fused loss keeps them from its forward on, the chunked makes them in backward)."""
    reduce_scatter: float = 0.0
    """One block's fp32 reduce-scatter input, kept by FSDP until the next block's reduce-scatter."""
    root_gradients: float = 0.0
    """The root's reduce-scatter at the end of backward: its gradients in the compute dtype and their fp32
    reduce-scatter input, or that input beside the output."""
    norm_working_set: float = 0.0
    """The final RMSNorm's fp32 temporaries in backward (its forward holds fewer), beside the output weight's
    and the hidden states' gradients: the loss phases' peak where the logits chunk is small."""
    phases: dict[str, float] = field(default_factory=dict)
    """Phase of the step -> bytes alive at its peak (docs/memory_model.md, "The phases")."""

    @property
    def total(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def as_dict(self) -> dict:
        terms = {k: v for k, v in asdict(self).items() if k != "phases"}
        return {**terms, "phases": dict(self.phases), "total": self.total, "peak_phase": self.peak_phase}


def _loss_transients(args: DecoderArgs, s: Switches, tokens: float) -> tuple[float, float, float, float]:
    """(forward, backward, beside the backward's, beside the forward's) bytes of the loss (``ops/loss/``, the
    ``loss_backend``'s; liger and cce counted as fused) over ``tokens`` rows; r rows a chunk (``chunk_rows``).

    Fused: the gradients made in forward, [T, D] in the compute dtype and the output weight's fp32 [V, D]
    (none when frozen: LoRA), kept from forward to backward, beside one chunk's logits, their fp32 copy
    (the eager sequence: on CUDA compiled, an upper bound), its cast back (and the softcap's derivative);
    backward, the weight gradient's cast to the compute dtype (the [T, D] gradient takes the place of the
    final norm's output, which ``saved`` counts and nothing keeps past the fused forward).
    Chunked: forward, the fp32 logits and
    their log-softmax; backward, the fp32 logits and their softmax (then the softmax, its compute-dtype
    cast and the hidden states' gradient of the chunk), beside the fp32 [V, D] and [T, D] gradients.
    Materialized: forward, the logits, their fp32 upcast (a copy in bf16) and log-softmax; backward, the
    saved log-softmax, its gradient and log_softmax's backward output.
    """
    a, v, d = s.act_bytes, args.vocab_size, args.dim
    cast = a if a < 4 else 0  # bytes of a copy to fp32 or back (none in fp32)
    weight_grad = 0.0 if s.lora_rank else 4 * v * d  # a frozen output weight has none
    if s.loss_backend == "materialized":
        return (a + (4 if cast else 0) + 4) * tokens * v, 12 * tokens * v, 0.0, 0.0
    r = min(chunk_rows(s.loss_chunk_size, int(tokens), v, d), tokens)
    if s.loss_backend == "chunked":
        forward = max(cast * r * v + 4 * r * v, 8 * r * v)
        backward = max(8 * r * v, (4 + cast) * r * v + a * r * d)
        return forward, backward, weight_grad + a * tokens * d, 0.0
    kept = weight_grad + a * tokens * d
    chunk = (a + 4 + cast + (4 if args.final_softcap else 0)) * r * v
    backward = max(a * v * d if weight_grad else 0.0, 8 * r * d if cast else 0.0)
    return chunk, backward, weight_grad, kept


class _Step:
    """The sizes one estimate shares between its steps (bytes unless named otherwise; notation:
    docs/memory_model.md). Filled in order by ``_states``, ``_kept``, ``_working_sets``, ``_loss_and_root``."""

    def __init__(self, args: DecoderArgs, layout: Layout, s: Switches, seq_len: int, local_batch: int):
        self.args, self.layout, self.s, self.a = args, layout, s, s.act_bytes
        self.tokens = local_batch * seq_len / (layout.sp * layout.cp)  # T
        self.d, self.q, self.kv, self.qa, self.kva_held, self.kva, self.f = widths(args, layout, s.act_bytes == 4)
        if args.moe is not None and not args.moe_dense_layers:  # no dense MLP: the experts' terms are moe_terms.py's
            self.f = 0
        self.n = layout.dp_shard * layout.cp * layout.sp


def estimate(args: DecoderArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1) -> Estimate:
    """The memory of one rank for a step of ``local_batch`` sequences of ``seq_len`` tokens."""
    if args.moe is not None and not args.moe_dense_layers:  # experts are never tiled: no MLP to tile
        switches = dataclasses.replace(switches, mlp_tile_size=0)
    c = _Step(args, layout, switches, seq_len, local_batch)
    _states(c)
    _kept(c)
    _working_sets(c)
    _loss_and_root(c)
    phases = _phases(c)
    return Estimate(
        unsharded_working_params=float(c.working), saved_activations=c.saved, layer_recompute=c.recompute,
        attention_working_set=c.attention_ws, mlp_working_set=float(c.mlp_ws),
        logits=float(max(c.loss_fwd, c.loss_bwd)), host_offloaded=c.host,
        loss_weight_gradient=float(c.loss_weight_grad), reduce_scatter=float(c.rs_block),
        root_gradients=float(c.root_grads), norm_working_set=float(c.norm_bwd),
        phases={k: float(v) for k, v in phases.items()}, **c.states,
    )


def _states(c: _Step) -> None:
    """Parameters, gradients and optimizer state, on the device and (FSDP CPU offload) on the host."""
    args, layout, s, a, d = c.args, c.layout, c.s, c.a, c.d
    # one block's parameters on a tp rank, and those a rank gathers (a mixture of experts: its E / ep experts)
    c.block, c.gathered = block_params(args, layout, d, c.q, c.kv, c.f)
    c.other = args.vocab_size * d * (1 if args.tie_embeddings else 2) + d
    shard = (args.n_layers * c.block + c.other) / c.n
    states = {"parameters": 4 * shard, "gradients": 4 * shard, "optimizer": 8 * shard}
    c.trained = c.block  # parameters of a block that have gradients
    if s.lora_rank:  # the frozen base in the compute dtype; the adapters alone train: rank x (in + out) each
        c.trained = s.lora_rank * (2 * (d + c.q) + 2 * (d + c.kv) + 3 * (d + c.f))
        lora_shard = args.n_layers * c.trained / c.n
        states = {"parameters": a * shard + 4 * lora_shard, "gradients": 4 * lora_shard, "optimizer": 8 * lora_shard}
    c.host_states = dict.fromkeys(states, 0.0)  # FSDP CPU offload's, in host memory
    if s.cpu_offload:
        c.host_states, states = states, c.host_states
    c.states = states
    c.block_grad = states["gradients"] and 4 * c.trained / c.n  # one block's sharded fp32 gradient (0 when offloaded)


def _kept(c: _Step) -> None:
    """What forward keeps for backward (saved), what a layer's recompute holds, and what offload puts on the host."""
    args, layout, s, a, d, tokens = c.args, c.layout, c.s, c.a, c.d, c.tokens
    c.per_layer = family_layer_bytes(args, layout, s, s.ac_mode)
    # token ids, the root's fp32 RoPE tables (cos and sin, [T, Dh/2] each), the final norm's input and scale, its output
    head = tokens * (8 + 4 * args.head_dim + (a * d + 4) + a * d)
    c.k = k = groups.group_size(s.ac_mode, s.ac_layers_per_checkpoint)
    inputs = groups.kept_inputs(args.n_layers, k)  # block inputs forward keeps: one per group
    c.saved = args.n_layers * c.per_layer * tokens + head
    if s.ac_mode == "full":
        c.saved -= (args.n_layers - inputs) * a * d * tokens
    c.rope_held = 4 * args.head_dim * tokens if k > 1 else 0.0  # the RoPE-sized term from the loss's backward on
    earlier_host = c.host_states["gradients"] if s.microbatches > 1 else 0.0
    c.host = groups.host_bytes(c.host_states["parameters"], c.host_states["gradients"], c.host_states["optimizer"],
                               earlier_host, inputs * a * d * tokens if s.ac_mode == "full_offload" else 0.0)
    full_set = family_layer_bytes(args, layout, s, "none")
    # what the layer's backward holds: its full set, of which the mode kept per_layer (selective keeps
    # tensors the full set does not -- the projections' outputs -- but they are released as the recompute
    # consumes them; with cp, the gathered K/V stay beside the prefixes recomputed from them)
    c.recompute = 0.0 if s.ac_mode == "none" else max(full_set - c.per_layer, 0.0) * tokens
    c.released, c.floor = 0.0, 0.0  # what the layer's recompute frees of its own saved tensors before the working sets
    if s.ac_mode == "selective" and s.head_stages > 1:
        # staged: the cache holds every stage's outputs; the recompute holds the norms' outputs and the MLP's
        # input (untiled: its SiLU and product too) and frees the stages' shares of the layer output as it sums them
        kept = stage_kept_per_token(args, layout, s) + a * d + (a * args.head_dim if a < 4 else 0)
        c.recompute = max(full_set - kept - (0 if s.mlp_tile_size else 2 * a * c.f), 0.0) * tokens
        c.released = s.head_stages * a * d * tokens
        # before it frees them: the output's gradient, the attention norm's output and one stage's forward
        c.floor = 2 * a * d * tokens + stage_bytes_per_token(args, layout, s)[0] * tokens
    if s.ac_mode == "selective" and layout.cp > 1:
        c.recompute += 2 * a * layout.cp * c.kva * tokens


def _working_sets(c: _Step) -> None:
    """The largest transients of a layer's backward: attention, the MLP (tiled, or a mixture of experts'), the norm."""
    args, layout, s, a, d, f, tokens = c.args, c.layout, c.s, c.a, c.d, c.f, c.tokens
    cp_kv = cp_kv_per_token(args, layout, s) * tokens if layout.cp > 1 else 0.0  # and as much of their gradients
    c.attention_ws = 3 * a * (c.qa + 2 * c.kva_held) * tokens + 2 * cp_kv
    if s.head_stages > 1:  # one stage at a time: its forward in the layer's recompute or its backward
        c.attention_ws = max(stage_bytes_per_token(args, layout, s)) * tokens + 2 * cp_kv
    if s.mlp_tile_size:  # ops/tiled.py: docs/memory_model.md, the working sets of a layer's backward
        tile = min(s.mlp_tile_size, tokens)
        tile_ws = 6 * a * f * tile + 2 * a * d * tile + 7 * a * d * f
        # beside the output's gradient: the input's gradient and one tile's backward; under AC, the
        # recompute's forward holds the tiles' outputs and their concatenation instead
        mlp_ws = a * d * tokens + max(a * d * tokens + tile_ws, 2 * a * d * tokens if s.ac_mode != "none" else 0.0)
    else:
        mlp_ws = 2 * a * f * tokens
    c.moe = moe = feed_forward_memory(args, layout, s)  # a mixture of experts' feed-forward (moe_terms.py), never tiled
    if moe:  # the combine's backward; under AC also the recompute's dispatch, beside the output's gradient
        mlp_ws = (moe.combine if s.ac_mode == "none" else max(moe.combine, moe.dispatch + a * d)) * tokens
    if s.lora_rank:  # the adapters' gradient of the MLP input beside the base projections' (measured)
        mlp_ws += a * d * tokens
    c.mlp_ws = mlp_ws
    # the final RMSNorm (ops/norm.py) computes in fp32, CHUNK_TOKENS tokens at a time in eager
    # mode: forward a chunk's upcast input, normalised input and its product with the weight;
    # backward five [chunk, D] fp32 tensors
    rows = min(tokens, NORM_CHUNK_TOKENS)
    upcast = 4 * d * rows if a < 4 else 0.0
    c.norm_fwd, c.norm_bwd = 8 * d * rows + upcast, 16 * d * rows + upcast
    # a layer's ffn_norm backward (after the MLP's backward freed its intermediates): the norm's fp32
    # temporaries and two residual-stream gradients beside the rest of the layer's activations
    ffn_saved = moe.saved if moe else a * d + (0 if s.mlp_tile_size else 4 * a * f)
    c.norm_ws = c.norm_bwd + 2 * a * d * tokens - ffn_saved * tokens
    # the tiled MLP's backward (and, under AC, the recompute's forward before it) comes first in the block's
    # backward: none of the block's gradients exist yet (its weights' gradients are the tiles' sums, above)
    c.layer_ws = max(c.attention_ws, mlp_ws - (a * c.trained if s.mlp_tile_size else 0.0), c.norm_ws)


def _loss_and_root(c: _Step) -> None:
    """The loss's transients, FSDP's working parameters, the root's reduce-scatter and the embeddings' backward."""
    args, layout, s, a, d, tokens = c.args, c.layout, c.s, c.a, c.d, c.tokens
    c.loss_fwd, c.loss_bwd, c.loss_weight_grad, c.loss_kept = _loss_transients(args, s, tokens)
    # the output weight's gradient in the compute dtype (none for a frozen one: LoRA)
    c.out_grad = out_grad = 0.0 if s.lora_rank else a * args.vocab_size * d
    c.root, c.one_block = root, one_block = a * c.other, a * c.gathered
    c.units = expert_units(args, layout, a, d, c.q, c.kv, c.gathered)  # a mixture of experts' block: its FSDP units
    # FSDP's last all-gather of forward (an MoE block's: its experts'), and the first block backward prefetches
    c.last_gather, c.first_prefetch = (c.units.last_gather, c.units.dense) if c.units else (one_block, one_block)
    c.rs_block = 4 * (c.trained if s.lora_rank else c.gathered)
    n, other = c.n, c.other
    # the root's reduce-scatter (FSDP's foreach_reduce): its gradients copied into the fp32 input,
    # then the input beside the output (a world of one: beside a full-size output and the quotient
    # by the divide factor, which FSDP computes out of place) and beside the last root gradient,
    # which FSDP still holds then (the output weight's, [vocab, D]): 1 GiB for Llama-3-8B in bf16,
    # which the tracker found missing at 1, 2 and 3 ranks
    # (tied embeddings: the last root gradient is the final norm's)
    c.root_grads = max((a + 4) * other, 4 * other * (1 + 1 / n + (1 if n == 1 else 0))
                       + (0.0 if args.tie_embeddings else out_grad))
    # the embeddings' backward, before it: the root still unsharded, the output weight's gradient,
    # the embeddings' own (tied: and their sum), the gradient of the embeddings' output and
    # block 0's reduce-scatter input
    c.embedding = root + a * args.vocab_size * d * (3 if args.tie_embeddings else 2) + a * tokens * d + c.rs_block
    if s.lora_rank:  # nothing of the root trains: no embeddings' backward, no root reduce-scatter
        c.embedding, c.root_grads = 0.0, 0.0
    c.rest = c.states["parameters"] + c.states["optimizer"]
    c.earlier = c.states["gradients"] if s.microbatches > 1 else 0.0  # gradients of earlier microbatches
    c.working = root + 3 * one_block  # root, this block, its gradients, the next block's all-gather
    if s.lora_rank:
        c.working = root + 2 * one_block + a * c.trained


def _layer_backward(c: _Step, i: int) -> float:
    """The backward of block i of n_layers, counted from the input."""
    args, s, a, d, tokens, k = c.args, c.s, c.a, c.d, c.tokens, c.k
    done = c.earlier or (args.n_layers - 1 - i) * c.block_grad
    held = c.rs_block if i < args.n_layers - 1 else 0.0  # the reduce-scatter input of block i + 1
    prefetch = c.one_block if i > 0 else 0.0  # block i - 1's all-gather
    if s.ac_mode == "full_offload" and i > 0:  # and its input, on its way back from the host
        prefetch += a * d * tokens
    common = (c.rest + done + c.out_grad + (i + 1) * c.per_layer * tokens
              + groups.layer_backward_extra(i, k, s.ac_mode, a * d * tokens, c.one_block, c.rope_held))
    if c.units:
        return common + _moe_layer_backward(c, i, prefetch - (c.one_block if i > 0 else 0.0))
    return common + c.working - c.one_block + prefetch + held + max(c.recompute + c.layer_ws - c.released, c.floor)


def _moe_layer_backward(c: _Step, i: int, offloaded: float) -> float:
    """An MoE block's backward beyond ``_layer_backward``'s common terms: the combine first (the block's other
    parameters gathered, its experts prefetched, block i + 1's last reduce-scatter input held), then the experts,
    the ffn norm and the attention after the feed-forward's tensors are freed (the block's other parameters and
    their gradients, the experts' reduce-scatter input, block i - 1's prefetch). ``offloaded``: block i - 1's input
    on its way back from the host."""
    units, s, tokens = c.units, c.s, c.tokens
    held = units.dense_reduce if i < c.args.n_layers - 1 else 0.0
    previous = units.dense if i > 0 else 0.0  # block i - 1's prefetched
    if units.experts:  # the experts' unit comes next: prefetched (under AC gathered by the recompute)
        first = units.last_gather + (units.experts if s.ac_mode != "none" else 0.0)
        after_held = units.experts_reduce
    else:  # one unit: block i - 1 comes next
        first, after_held = previous, held
    combine = c.root + units.dense + first + held + c.recompute + c.mlp_ws
    rest_ws = max(c.attention_ws - c.moe.saved * tokens, c.norm_ws)
    after = c.root + 2 * units.dense + after_held + previous + max(c.recompute + rest_ws - c.released, c.floor)
    return offloaded + max(combine, after)


def _phases(c: _Step) -> dict[str, float]:
    """Phase of the step -> the bytes alive together at its peak."""
    args, s, a, d, tokens, k = c.args, c.s, c.a, c.d, c.tokens, c.k
    rest, earlier, root = c.rest, c.earlier, c.root
    embedding = c.embedding
    reduced = args.n_layers * c.block_grad  # the blocks' sharded gradients in the embeddings' backward
    if c.units:  # block 0's other parameters and their gradients still gathered, its last reduce-scatter input,
        # only its experts' gradients sharded (the tracker's; the dense count was fitted to Llama's shapes)
        embedding += 2 * c.units.dense + (c.units.experts_reduce or c.units.dense_reduce) - c.rs_block
        reduced -= 4 * c.units.dense / a / c.n
    top = (args.n_layers - 1) // k  # the top group (k = 1: the top layer)
    phases = {
        "loss forward": rest + earlier + root + c.last_gather + c.saved + max(c.loss_kept + c.loss_fwd, c.norm_fwd),
        "loss backward": rest + earlier + root + c.first_prefetch + c.saved + c.rope_held
        + max(c.loss_weight_grad + c.loss_bwd, c.out_grad + a * tokens * d + c.norm_bwd),
        "layer backward": max(_layer_backward(c, i) for i in range(args.n_layers) if i // k in (0, 1, top - 1, top)),
        "embedding backward": rest + (earlier or reduced) + max(embedding, c.root_grads),
        "optimizer step": rest + c.states["gradients"],
    }
    if s.lora_rank:  # backward ends with block 0's: the frozen embeddings' input needs no gradient
        del phases["embedding backward"]
    if c.moe and s.ac_mode == "none":  # the top layer's dispatch: every layer's saved tensors and the token ids and
        # RoPE tables, its units gathered (and its experts' all-gather buffer)
        units = c.units
        phases = {"forward": rest + earlier + root + units.dense + units.experts + units.last_gather
                  + (args.n_layers * c.per_layer + c.moe.dispatch + 8 + 4 * args.head_dim) * tokens, **phases}
    return phases


def largest_seq_len(args, layout, switches, device_bytes: float, local_batch: int = 1, multiple: int = 1024) -> int:
    """The longest seq_len (a multiple of ``multiple`` and of sp, or 2 x cp x sp) whose estimate fits ``device_bytes``."""
    step = multiple * layout.sp * (2 * layout.cp if layout.cp > 1 else 1)
    lo, hi = 0, step
    while estimate(args, layout, switches, hi, local_batch).total <= device_bytes:
        lo, hi = hi, hi * 2
        if hi > 2**34:
            break
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if estimate(args, layout, switches, mid, local_batch).total <= device_bytes:
            lo = mid
        else:
            hi = mid
    return lo
