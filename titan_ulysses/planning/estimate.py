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


def estimate(args: DecoderArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1) -> Estimate:
    """The memory of one rank for a step of ``local_batch`` sequences of ``seq_len`` tokens."""
    if args.moe is not None and not args.moe_dense_layers:  # experts are never tiled: no MLP to tile
        switches = dataclasses.replace(switches, mlp_tile_size=0)
    s, a = switches, switches.act_bytes
    tokens = local_batch * seq_len / (layout.sp * layout.cp)  # T
    d, q, kv, qa, kva_held, kva, f = widths(args, layout, s.act_bytes == 4)
    if args.moe is not None and not args.moe_dense_layers:  # no dense MLP: the experts' terms are moe_terms.py's
        f = 0
    n = layout.dp_shard * layout.cp * layout.sp
    # one block's parameters on a tp rank, and those a rank gathers (a mixture of experts: its E / ep experts)
    block, gathered = block_params(args, layout, d, q, kv, f)
    other = args.vocab_size * d * (1 if args.tie_embeddings else 2) + d
    shard = (args.n_layers * block + other) / n
    states = {"parameters": 4 * shard, "gradients": 4 * shard, "optimizer": 8 * shard}
    trained = block  # parameters of a block that have gradients
    if s.lora_rank:  # the frozen base in the compute dtype; the adapters alone train: rank x (in + out) each
        trained = s.lora_rank * (2 * (d + q) + 2 * (d + kv) + 3 * (d + f))
        lora_shard = args.n_layers * trained / n
        states = {"parameters": a * shard + 4 * lora_shard, "gradients": 4 * lora_shard, "optimizer": 8 * lora_shard}
    host_states = dict.fromkeys(states, 0.0)  # FSDP CPU offload's, in host memory
    if s.cpu_offload:
        host_states, states = states, host_states
    block_grad = states["gradients"] and 4 * trained / n  # one block's sharded fp32 gradient (0 when offloaded)
    per_layer = family_layer_bytes(args, layout, s, s.ac_mode)
    # token ids, the root's fp32 RoPE tables (cos and sin, [T, Dh/2] each), the final norm's input and scale, its output
    head = tokens * (8 + 4 * args.head_dim + (a * d + 4) + a * d)
    k = groups.group_size(s.ac_mode, s.ac_layers_per_checkpoint)
    inputs = groups.kept_inputs(args.n_layers, k)  # block inputs forward keeps: one per group
    saved = args.n_layers * per_layer * tokens + head
    if s.ac_mode == "full":
        saved -= (args.n_layers - inputs) * a * d * tokens
    rope_held = 4 * args.head_dim * tokens if k > 1 else 0.0  # the RoPE-sized term from the loss's backward on
    earlier_host = host_states["gradients"] if s.microbatches > 1 else 0.0
    host = groups.host_bytes(host_states["parameters"], host_states["gradients"], host_states["optimizer"],
                             earlier_host, inputs * a * d * tokens if s.ac_mode == "full_offload" else 0.0)
    full_set = family_layer_bytes(args, layout, s, "none")
    # what the layer's backward holds: its full set, of which the mode kept per_layer (selective keeps
    # tensors the full set does not -- the projections' outputs -- but they are released as the recompute
    # consumes them; with cp, the gathered K/V stay beside the prefixes recomputed from them)
    recompute = 0.0 if s.ac_mode == "none" else max(full_set - per_layer, 0.0) * tokens
    released, floor = 0.0, 0.0  # what the layer's recompute frees of its own saved tensors before the working sets
    if s.ac_mode == "selective" and s.head_stages > 1:
        # staged: the cache holds every stage's outputs; the recompute holds the norms' outputs and the MLP's
        # input (untiled: its SiLU and product too) and frees the stages' shares of the layer output as it sums them
        kept = stage_kept_per_token(args, layout, s) + a * d + (a * args.head_dim if a < 4 else 0)
        recompute = max(full_set - kept - (0 if s.mlp_tile_size else 2 * a * f), 0.0) * tokens
        released = s.head_stages * a * d * tokens
        # before it frees them: the output's gradient, the attention norm's output and one stage's forward
        floor = 2 * a * d * tokens + stage_bytes_per_token(args, layout, s)[0] * tokens
    if s.ac_mode == "selective" and layout.cp > 1:
        recompute += 2 * a * layout.cp * kva * tokens
    cp_kv = cp_kv_per_token(args, layout, s) * tokens if layout.cp > 1 else 0.0  # and as much of their gradients
    attention_ws = 3 * a * (qa + 2 * kva_held) * tokens + 2 * cp_kv
    if s.head_stages > 1:  # one stage at a time: its forward in the layer's recompute or its backward
        attention_ws = max(stage_bytes_per_token(args, layout, s)) * tokens + 2 * cp_kv
    if s.mlp_tile_size:  # ops/tiled.py: docs/memory_model.md, the working sets of a layer's backward
        tile = min(s.mlp_tile_size, tokens)
        tile_ws = 6 * a * f * tile + 2 * a * d * tile + 7 * a * d * f
        # beside the output's gradient: the input's gradient and one tile's backward; under AC, the
        # recompute's forward holds the tiles' outputs and their concatenation instead
        mlp_ws = a * d * tokens + max(a * d * tokens + tile_ws, 2 * a * d * tokens if s.ac_mode != "none" else 0.0)
    else:
        mlp_ws = 2 * a * f * tokens
    moe = feed_forward_memory(args, layout, s)  # a mixture of experts' feed-forward (moe_terms.py), never tiled
    if moe:  # the combine's backward; under AC also the recompute's dispatch, beside the output's gradient
        mlp_ws = (moe.combine if s.ac_mode == "none" else max(moe.combine, moe.dispatch + a * d)) * tokens
    if s.lora_rank:  # the adapters' gradient of the MLP input beside the base projections' (measured)
        mlp_ws += a * d * tokens
    loss_fwd, loss_bwd, loss_weight_grad, loss_kept = _loss_transients(args, s, tokens)
    # the output weight's gradient in the compute dtype (none for a frozen one: LoRA)
    out_grad = 0.0 if s.lora_rank else a * args.vocab_size * d
    # the final RMSNorm (ops/norm.py) computes in fp32, CHUNK_TOKENS tokens at a time in eager
    # mode: forward a chunk's upcast input, normalised input and its product with the weight;
    # backward five [chunk, D] fp32 tensors
    rows = min(tokens, NORM_CHUNK_TOKENS)
    upcast = 4 * d * rows if a < 4 else 0.0
    norm_fwd, norm_bwd = 8 * d * rows + upcast, 16 * d * rows + upcast

    root, one_block = a * other, a * gathered
    units = expert_units(args, layout, a, d, q, kv, gathered)  # a mixture of experts' block: its FSDP units
    # FSDP's last all-gather of forward (an MoE block's: its experts'), and the first block backward prefetches
    last_gather, first_prefetch = (units.last_gather, units.dense) if units else (one_block, one_block)
    rs_block = 4 * (trained if s.lora_rank else gathered)
    # the root's reduce-scatter (FSDP's foreach_reduce): its gradients copied into the fp32 input,
    # then the input beside the output (a world of one: beside a full-size output and the quotient
    # by the divide factor, which FSDP computes out of place) and beside the last root gradient,
    # which FSDP still holds then (the output weight's, [vocab, D]): 1 GiB for Llama-3-8B in bf16,
    # which the tracker found missing at 1, 2 and 3 ranks
    # (tied embeddings: the last root gradient is the final norm's)
    root_grads = max((a + 4) * other, 4 * other * (1 + 1 / n + (1 if n == 1 else 0))
                     + (0.0 if args.tie_embeddings else out_grad))
    # the embeddings' backward, before it: the root still unsharded, the output weight's gradient,
    # the embeddings' own (tied: and their sum), the gradient of the embeddings' output and
    # block 0's reduce-scatter input
    embedding = root + a * args.vocab_size * d * (3 if args.tie_embeddings else 2) + a * tokens * d + rs_block
    if s.lora_rank:  # nothing of the root trains: no embeddings' backward, no root reduce-scatter
        embedding, root_grads = 0.0, 0.0
    rest = states["parameters"] + states["optimizer"]
    earlier = states["gradients"] if s.microbatches > 1 else 0.0  # gradients of earlier microbatches
    working = root + 3 * one_block  # root, this block, its gradients, the next block's all-gather
    if s.lora_rank:
        working = root + 2 * one_block + a * trained

    def layer_backward(i: int) -> float:  # block i of n_layers, counted from the input
        done = earlier or (args.n_layers - 1 - i) * block_grad
        held = rs_block if i < args.n_layers - 1 else 0.0  # the reduce-scatter input of block i + 1
        prefetch = one_block if i > 0 else 0.0  # block i - 1's all-gather
        if s.ac_mode == "full_offload" and i > 0:  # and its input, on its way back from the host
            prefetch += a * d * tokens
        common = (rest + done + out_grad + (i + 1) * per_layer * tokens
                  + groups.layer_backward_extra(i, k, s.ac_mode, a * d * tokens, one_block, rope_held))
        if units:
            return common + moe_layer_backward(i, prefetch - (one_block if i > 0 else 0.0))
        return common + working - one_block + prefetch + held + max(recompute + layer_ws - released, floor)

    def moe_layer_backward(i: int, offloaded: float) -> float:
        """An MoE block's backward beyond ``common``: the combine first (the block's other parameters gathered,
        its experts prefetched, block i + 1's last reduce-scatter input held), then the experts, the ffn norm and
        the attention after the feed-forward's tensors are freed (the block's other parameters and their
        gradients, the experts' reduce-scatter input, block i - 1's prefetch). ``offloaded``: block i - 1's input
        on its way back from the host."""
        held = units.dense_reduce if i < args.n_layers - 1 else 0.0
        previous = units.dense if i > 0 else 0.0  # block i - 1's prefetched
        if units.experts:  # the experts' unit comes next: prefetched (under AC gathered by the recompute)
            first = units.last_gather + (units.experts if s.ac_mode != "none" else 0.0)
            after_held = units.experts_reduce
        else:  # one unit: block i - 1 comes next
            first, after_held = previous, held
        combine = root + units.dense + first + held + recompute + mlp_ws
        rest_ws = max(attention_ws - moe.saved * tokens, norm_ws)
        after = root + 2 * units.dense + after_held + previous + max(recompute + rest_ws - released, floor)
        return offloaded + max(combine, after)

    # a layer's ffn_norm backward (after the MLP's backward freed its intermediates): the norm's fp32
    # temporaries and two residual-stream gradients beside the rest of the layer's activations
    ffn_saved = moe.saved if moe else a * d + (0 if s.mlp_tile_size else 4 * a * f)
    norm_ws = norm_bwd + 2 * a * d * tokens - ffn_saved * tokens
    # the tiled MLP's backward (and, under AC, the recompute's forward before it) comes first in the block's
    # backward: none of the block's gradients exist yet (its weights' gradients are the tiles' sums, above)
    layer_ws = max(attention_ws, mlp_ws - (a * trained if s.mlp_tile_size else 0.0), norm_ws)
    reduced = args.n_layers * block_grad  # the blocks' sharded gradients in the embeddings' backward
    if units:  # block 0's other parameters and their gradients still gathered, its last reduce-scatter input,
        # only its experts' gradients sharded (the tracker's; the dense count was fitted to Llama's shapes)
        embedding += 2 * units.dense + (units.experts_reduce or units.dense_reduce) - rs_block
        reduced -= 4 * units.dense / a / n
    top = (args.n_layers - 1) // k  # the top group (k = 1: the top layer)
    phases = {
        "loss forward": rest + earlier + root + last_gather + saved + max(loss_kept + loss_fwd, norm_fwd),
        "loss backward": rest + earlier + root + first_prefetch + saved + rope_held
        + max(loss_weight_grad + loss_bwd, out_grad + a * tokens * d + norm_bwd),
        "layer backward": max(layer_backward(i) for i in range(args.n_layers) if i // k in (0, 1, top - 1, top)),
        "embedding backward": rest + (earlier or reduced) + max(embedding, root_grads),
        "optimizer step": rest + states["gradients"],
    }
    if s.lora_rank:  # backward ends with block 0's: the frozen embeddings' input needs no gradient
        del phases["embedding backward"]
    if moe and s.ac_mode == "none":  # the top layer's dispatch: every layer's saved tensors and the token ids and
        # RoPE tables, its units gathered (and its experts' all-gather buffer)
        phases = {"forward": rest + earlier + root + units.dense + units.experts + units.last_gather
                  + (args.n_layers * per_layer + moe.dispatch + 8 + 4 * args.head_dim) * tokens, **phases}
    return Estimate(
        unsharded_working_params=float(working), saved_activations=saved, layer_recompute=recompute,
        attention_working_set=attention_ws, mlp_working_set=float(mlp_ws), logits=float(max(loss_fwd, loss_bwd)),
        host_offloaded=host, loss_weight_gradient=float(loss_weight_grad), reduce_scatter=float(rs_block),
        root_gradients=float(root_grads), norm_working_set=float(norm_bwd),
        phases={k: float(v) for k, v in phases.items()}, **states,
    )


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
