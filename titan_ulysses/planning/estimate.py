"""Per-device memory of a training step, from the config alone (pure arithmetic).

Notation, per rank: T = B x S / (cp x sp) local tokens; a = bytes of an activation (the FSDP
compute dtype: 2 for bf16, 4 for fp32); D model dim; q = Hq x Dh / tp and kv = Hkv x Dh / tp
the local q and kv widths; r the kv replication factor of Ulysses; F = ffn_hidden / tp;
V vocabulary; N layers. Where Ulysses splits the heads unevenly (``distributed/heads.py``),
the attention terms below are those of the busiest rank: ``q`` and ``r kv`` become its
heads times sp, and a rank that expands its kv heads to one per q head keeps both copies.
In fp32 with GQA (no cp) CUDA's sdpa kernels other than flash need a kv head per q head
(``ops/attention.py``): attention keeps the expanded k and v instead.

What autograd keeps per layer and local token without activation checkpointing, read off
``models/llama/model.py`` (bytes):

* RMSNorm x2: its input and one fp32 scale per token, ``aD + 4`` each (``ops/norm.py``);
* the q/k/v projections' input (the norm output): ``aD``;
* RoPE on q and k: its fp32 cos/sin tables are shared by all layers (``4 Dh`` per token, once,
  with the final norm's input: the root holds them to the end of backward), but in bf16 FSDP casts
  every block's floating-point inputs to the compute dtype (``MixedPrecisionPolicy``'s
  ``cast_forward_inputs``), so each block keeps its own bf16 copy of both: ``a Dh`` (kept
  under every AC mode: they are the checkpoint's inputs; fp32: no copy);
* attention: q, k, v of the whole sequence and my heads -- one all-to-all buffer,
  ``a(q + 2 r kv)`` -- its output ``aq`` and logsumexp ``4 Hq/tp``;
* the output projection's input: ``aq`` after the return all-to-all (sp > 1); without
  Ulysses it is a view of the attention output, already counted;
* the MLP: its input ``aD``, w1 and w3 outputs, SiLU output and their product: ``4aF``
  (tiled MLP: the input only).

Selective AC keeps the matmul, attention and all-to-all outputs (``a(q + 2kv) + 2aD + 2aF``,
the attention terms and the block input; with a tiled MLP, whose matmuls run inside its
own recompute, not ``aD + 2aF``: ``distributed/activation_checkpoint.py``); full AC keeps
the block input ``aD``; full_offload keeps it in host memory, and under both the block's bf16
RoPE copies stay on the device (the checkpoint holds the ``(cos, sin)`` tuple itself, which no
saved-tensor hook sees, so ``activation_offload.py`` cannot move it: ``a Dh`` per token and
layer). Under AC the backward of a layer holds again what its mode did not keep (the recompute,
``layer_recompute``; under selective AC with cp, the gathered K/V stay beside the prefixes
recomputed from them).

The peak is the largest of the phases of a steady-state step (``Estimate.phases``), each
checked against PyTorch's ``FSDPMemTracker`` under fake tensors on CPU
(``metrics/memory_track.py``, ``scripts/estimate_memory.py --track``). Always resident:
fp32 master weights sharded by FSDP over dp_shard x cp x sp (blocks also over tp) and two
fp32 AdamW states alike. The trainer zeroes gradients with ``set_to_none``, so the sharded
fp32 gradients exist only from each block's reduce-scatter in backward until the optimizer
step (with gradient accumulation, ``Switches.microbatches > 1``, from the first microbatch
on). FSDP keeps the root's parameters (embeddings, final norm, output) unsharded in the
compute dtype from forward to the end of backward (``distributed/fsdp.py``:
``reshard_after_forward=False``), and its last all-gather buffer, one block's worth, until
the next all-gather. The phases:

* loss forward: everything forward saved, plus the logits of one chunk (``logits``): the
  chunked loss (``ops/loss.py``) holds ``chunk x V`` fp32 logits and their log-softmax,
  ``8 chunk V``; unchunked, the compute-dtype logits, their fp32 upcast and log-softmax;
* loss backward: the same, with the chunked loss's fp32 ``[V, D]`` output-weight gradient
  and the hidden states' gradient (``loss_weight_gradient``) beside a chunk's fp32 logits
  and softmax (``8 chunk V``); unchunked, the saved fp32 log-probabilities, their gradient
  and log-softmax's backward output (``12 T V``); one block prefetched. Where the chunk is
  small, the final RMSNorm's fp32 temporaries are the peak of both loss phases instead
  (``norm_working_set``: ``16 D T`` bytes in backward plus a ``4 D T`` upcast in bf16);
* each layer's backward (the largest of the last two and the first two layers: the terms
  are linear in the layer index between them; checkpointed in groups, of the last two and the
  first two groups, with ``memory_groups.py``'s terms): the sharded gradients of the blocks
  after it, the root's parameters and the output weight's gradient in the compute dtype,
  this block's unsharded parameters and gradients and the next block's all-gather
  (``unsharded_working_params``; block 0 has no next; under full_offload also the input of the
  block below, ``aD`` per token, on its way back from the host while this block runs its
  backward), the previous block's fp32 reduce-scatter input, which FSDP keeps until the next
  reduce-scatter (``reduce_scatter``), the saved activations of
  this layer and the ones below, the recompute, and the largest of the attention's, the
  MLP's and the ffn_norm's backward working sets (the last: its fp32 temporaries, as the
  final norm's below, and two residual-stream gradients, once the MLP's intermediates are
  freed; the peak where the MLP is tiled);
* the embeddings' backward and the root's reduce-scatter at the end of backward: every
  block's sharded gradients, and the larger of the embeddings' backward (the root's
  parameters, the output weight's and the embeddings' gradients, block 0's reduce-scatter
  input) and the root's reduce-scatter (its gradients in the compute dtype and their fp32
  reduce-scatter input; the root's parameters are resharded before it; in a world of one,
  the input beside a full-size output and FSDP's out-of-place division, and the output weight's
  gradient, the last root gradient, unless the embeddings are tied; ``root_gradients``);
* the optimizer step: parameters, gradients and states (the fused AdamW of CUDA allocates
  no temporaries).

The forward of a layer holds less than its backward (no gradients), so it is not a phase
here. Working sets, counted at their peak: the attention's (the all-to-all send and receive
buffers and attention gradients, ``3 a (q + 2 r kv)`` per token) and the MLP's backward (its
output's gradient, the SiLU and product gradients beside the recomputed intermediates,
``2aF`` per token beyond the recompute; tiled, ``ops/tiled.py``: the output's and the input's
gradients, ``2aD`` per token, beside one tile's recompute and backward, ``6aF + 2aD`` per tile
token, and the MLP weights' gradients -- their sums over the tiles before, the previous tile's and
the one being made, ``7 a DF``; under AC the recompute's forward before it holds the tiles'
outputs and their concatenation, ``2aD`` per token, beside the output's gradient instead. The
tiled MLP's backward comes first in the block's: none of the block's gradients exist yet.
At one GPU and millions of tokens that is the peak: the 1B shape's whole 2M tokens over one rank
hold eight ``[T, D]`` tensors at the concatenation under full_offload: the block's input, the
next one's, the two norms' outputs, the residual, the output's gradient, the tiles and the
concatenation).
CPU offload moves the sharded parameters, gradients and optimizer state to host memory
(``host_offloaded``: their peak beside full_offload's block inputs, ``memory_groups.host_bytes``).
Not modelled: the CUDA context and NCCL buffers (about 1-3 GiB on an H100), allocator
fragmentation, CUDA kernels' workspaces (cuBLAS, the flash attention backward's fp32 dq
accumulator; on an H200, 0.06 GiB beyond the tracker at the 8B's peak, so the estimate is
that much under ``max_memory_allocated``: ``memory_fit.BUDGET`` leaves 10% of the device
for all of these), torch.compile's buffers and its fusions (compiled norms and SiLU keep
fewer fp32 temporaries: compiled steps need less). ``scripts/estimate_memory.py
--validate`` compares the estimate with a measured step on CUDA, ``--track`` with the CPU
tracker.

Head-staged attention (``Switches.head_stages`` > 1, ``distributed/staged_attention.py``): a layer
keeps no attention tensor and no output-projection input past its backward (each stage is its
own checkpoint, keeping only the norm's output, counted above); its backward holds one stage at
a time, the larger of (``stage_bytes_per_token``) the stage's forward inside the layer's recompute
(the stages' sum so far and the last share of the layer output beside its projections and RoPE's
fp32 temporaries: at sp=8 with one head per stage, the layer's peak) and its backward (the
kernel's saved q/k/v, output and their gradients, or the stage's gradient of the norm's output
and its sum with the earlier stages'). With ``Switches.stage_keep_attention`` (``distributed/stage_keep.py``)
the stages keep their kernel's outputs, every stage's output and fp32 logsumexp, ``a q + 4 Hq``
per token for the busiest rank (``stage_kept_per_token``; q/k/v are still recomputed one stage at
a time): without AC from forward to the layer's backward, as plain Ulysses keeps its attention
output; under full AC or full_offload only in the layer's backward (its recompute records them,
each stage's recompute takes its own), so they are part of the recompute there; a stage's own
output and logsumexp are then not counted twice. Selective AC's policy sees the ops inside every
stage's checkpoint, keep or not: its cache holds each stage's projections, all-to-all and kernel
outputs and its ``[T, D]`` share of the layer output (``stage_selective_per_token``: G shares
where plain Ulysses keeps one), and the layer's recompute frees the shares as it sums them.
Against the tracker (the 1B shape, two layers, 8 stages, 128K tokens, one rank and sp=2): keep
adds what the tracker adds to each phase to the byte under none, full and full_offload; selective
3% to 4% over in a layer's backward. Without keep, at the peak (a layer's backward): the 1B shape
at 2M tokens on one GPU (``llama3_1b_2m_one_gpu.toml``) +0.1%, the 8B at 1.2M on one H200 +0.4%
(27% and 30% under before the tiled MLP's gradients, the host prefetch and the RoPE copies were
counted); the 8B over sp=8 with 4 stages, three layers, 1M and 4M tokens: -0.1%, +0.8%; the staged
cases of ``tests/test_memory_track.py`` -0.0% in a layer's backward.

Context parallelism (cp > 1, ``distributed/context_parallel.py``) adds, per layer, the keys and
values each of a rank's two chunks attends to: the prefixes of the gathered K/V that end with
the chunk, ``(2cp + 1) / 2cp`` of the sequence together: ``a r kv (2cp + 1)`` per local token in
bf16 (the flash kernel takes GQA), ``a q (2cp + 1)`` in fp32 (expanded to the q heads), kept for
backward (recomputed under full AC; selective AC keeps the all-gathered K/V they are cut
from instead, ``2 a cp r kv``); the attention working set grows by their gradients.
Parameters shard over dp_shard x cp x sp. Not modelled: packed documents' masks (none is
``[S, S]`` above 16M elements: ``ops/attention/registry.py``; sdpa's per-document op keeps only
q, k, v and recomputes the segments in backward, the same terms as above).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from titan_ulysses.planning import groups
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.layer_terms import (
    cp_kv_per_token,
    layer_bytes_per_token,
    stage_bytes_per_token,
    stage_kept_per_token,
    widths,
)
from titan_ulysses.ops.norm import CHUNK_TOKENS as NORM_CHUNK_TOKENS
from titan_ulysses.models.llama.args import LlamaArgs


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
    """The loss's largest transient over tokens x vocabulary (one chunk with ``loss_chunk_size``)."""
    host_offloaded: float
    """Bytes moved to host memory (not in ``total``)."""
    loss_weight_gradient: float = 0.0
    """The chunked loss backward's fp32 [V, D] output-weight gradient and the hidden states' gradient."""
    reduce_scatter: float = 0.0
    """One block's fp32 reduce-scatter input, kept by FSDP until the next block's reduce-scatter."""
    root_gradients: float = 0.0
    """The root's reduce-scatter at the end of backward: its gradients in the compute dtype and their fp32
    reduce-scatter input, or that input beside the output."""
    norm_working_set: float = 0.0
    """The final RMSNorm's fp32 temporaries in backward (its forward holds fewer), beside the output weight's
    and the hidden states' gradients: the loss phases' peak where the logits chunk is small."""
    phases: dict[str, float] = field(default_factory=dict)
    """Phase of the step -> bytes alive at its peak (see the module docstring)."""

    @property
    def total(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    def as_dict(self) -> dict:
        terms = {k: v for k, v in asdict(self).items() if k != "phases"}
        return {**terms, "phases": dict(self.phases), "total": self.total, "peak_phase": self.peak_phase}


def _loss_transients(args: LlamaArgs, s: Switches, tokens: float) -> tuple[float, float, float]:
    """(forward, backward, beside the backward's logits) bytes of the loss (``ops/loss.py``) over ``tokens`` rows.

    Chunked, per chunk of r rows: forward, the fp32 logits and their log-softmax; backward,
    the fp32 logits and their softmax (then the softmax, its compute-dtype cast and the hidden
    states' gradient of the chunk), beside the whole fp32 [V, D] gradient and [T, D] hidden
    gradient. Unchunked: forward, the logits, their fp32 upcast (a copy in bf16) and
    log-softmax; backward, the saved log-softmax, its gradient and log_softmax's backward output.
    """
    a, v, d = s.act_bytes, args.vocab_size, args.dim
    cast = a if a < 4 else 0  # bytes of a copy to fp32 or back (none in fp32)
    if s.loss_chunk_size:
        r = min(s.loss_chunk_size, tokens)
        forward = max(cast * r * v + 4 * r * v, 8 * r * v)
        backward = max(8 * r * v, (4 + cast) * r * v + a * r * d)
        return forward, backward, 4 * v * d + a * tokens * d
    return (a + (4 if cast else 0) + 4) * tokens * v, 12 * tokens * v, 0.0


def estimate(args: LlamaArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1) -> Estimate:
    """The memory of one rank for a step of ``local_batch`` sequences of ``seq_len`` tokens."""
    s, a = switches, switches.act_bytes
    tokens = local_batch * seq_len / (layout.sp * layout.cp)  # T
    d, q, kv, qa, kva_held, kva, f = widths(args, layout, s.act_bytes == 4)
    n = layout.dp_shard * layout.cp * layout.sp
    block = 2 * d * (q + kv) + 3 * d * f + 2 * d  # one block's parameters on a tp rank
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
    per_layer = layer_bytes_per_token(args, layout, s, s.ac_mode)
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
    full_set = layer_bytes_per_token(args, layout, s, "none")
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
    if s.mlp_tile_size:  # ops/tiled.py: see the module docstring
        tile = min(s.mlp_tile_size, tokens)
        tile_ws = 6 * a * f * tile + 2 * a * d * tile + 7 * a * d * f
        # beside the output's gradient: the input's gradient and one tile's backward; under AC, the
        # recompute's forward holds the tiles' outputs and their concatenation instead
        mlp_ws = a * d * tokens + max(a * d * tokens + tile_ws, 2 * a * d * tokens if s.ac_mode != "none" else 0.0)
    else:
        mlp_ws = 2 * a * f * tokens
    if s.lora_rank:  # the adapters' gradient of the MLP input beside the base projections' (measured)
        mlp_ws += a * d * tokens
    loss_fwd, loss_bwd, loss_weight_grad = _loss_transients(args, s, tokens)
    # the output weight's gradient in the compute dtype (none for a frozen one: LoRA)
    out_grad = 0.0 if s.lora_rank else a * args.vocab_size * d
    if s.lora_rank and s.loss_chunk_size:
        loss_weight_grad -= 4 * args.vocab_size * d
    # the final RMSNorm (ops/norm.py) computes in fp32, CHUNK_TOKENS tokens at a time in eager
    # mode: forward a chunk's upcast input, normalised input and its product with the weight;
    # backward five [chunk, D] fp32 tensors
    rows = min(tokens, NORM_CHUNK_TOKENS)
    upcast = 4 * d * rows if a < 4 else 0.0
    norm_fwd, norm_bwd = 8 * d * rows + upcast, 16 * d * rows + upcast

    root, one_block = a * other, a * block
    rs_block = 4 * trained
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
        return (rest + done + working - one_block + prefetch + out_grad + held
                + (i + 1) * per_layer * tokens + max(recompute + layer_ws - released, floor)
                + groups.layer_backward_extra(i, k, s.ac_mode, a * d * tokens, one_block, rope_held))

    # a layer's ffn_norm backward (after the MLP's backward freed its intermediates): the norm's fp32
    # temporaries and two residual-stream gradients beside the rest of the layer's activations
    norm_ws = norm_bwd + 2 * a * d * tokens - (a * d + (0 if s.mlp_tile_size else 4 * a * f)) * tokens
    # the tiled MLP's backward (and, under AC, the recompute's forward before it) comes first in the block's
    # backward: none of the block's gradients exist yet (its weights' gradients are the tiles' sums, above)
    layer_ws = max(attention_ws, mlp_ws - (a * trained if s.mlp_tile_size else 0.0), norm_ws)
    top = (args.n_layers - 1) // k  # the top group (k = 1: the top layer)
    phases = {
        "loss forward": rest + earlier + root + one_block + saved + max(loss_fwd, norm_fwd),
        "loss backward": rest + earlier + root + one_block + saved + rope_held
        + max(loss_weight_grad + loss_bwd, out_grad + a * tokens * d + norm_bwd),
        "layer backward": max(layer_backward(i) for i in range(args.n_layers) if i // k in (0, 1, top - 1, top)),
        "embedding backward": rest + (earlier or args.n_layers * block_grad) + max(embedding, root_grads),
        "optimizer step": rest + states["gradients"],
    }
    if s.lora_rank:  # backward ends with block 0's: the frozen embeddings' input needs no gradient
        del phases["embedding backward"]
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
