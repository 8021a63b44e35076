"""Per-device memory of a training step, from the config alone (pure arithmetic).

Notation, per rank: T = B x S / (cp x sp) local tokens; a = bytes of an activation (the FSDP
compute dtype: 2 for bf16, 4 for fp32); D model dim; q = Hq x Dh / tp and kv = Hkv x Dh / tp
the local q and kv widths; r the kv replication factor of Ulysses; F = ffn_hidden / tp;
V vocabulary; N layers. Where Ulysses splits the heads unevenly (``distributed/heads.py``),
the attention terms below are those of the busiest rank: ``q`` and ``r kv`` become its
heads times sp, and a rank that expands its kv heads to one per q head keeps both copies.

What autograd keeps per layer and local token without activation checkpointing, read off
``models/llama/model.py`` (bytes):

* RMSNorm x2: its input and one fp32 scale per token, ``aD + 4`` each (``ops/norm.py``);
* the q/k/v projections' input (the norm output): ``aD``;
* RoPE on q and k: nothing per layer (its cos/sin tables are shared by all layers);
* attention: q, k, v of the whole sequence and my heads -- one all-to-all buffer,
  ``a(q + 2 r kv)`` -- its output ``aq`` and logsumexp ``4 Hq/tp``;
* the output projection's input: ``aq`` after the return all-to-all (sp > 1); without
  Ulysses it is a view of the attention output, already counted;
* the MLP: its input ``aD``, w1 and w3 outputs, SiLU output and their product: ``4aF``
  (tiled MLP: the input only).

Selective AC keeps the matmul, attention and all-to-all outputs (``a(q + 2kv) + 2aD + 2aF``,
the attention terms and the block input); full AC keeps the block input ``aD``;
full_offload keeps it in host memory. Under AC the backward of a layer briefly holds its
full set again (the recompute), counted once. Transients counted at their peak: the
all-to-all send and receive buffers and attention gradients (``3 a (q + 2 r kv)`` per token),
the MLP backward (``2aF`` per token, or per tile), and the logits: ``T x V`` in the
compute dtype plus fp32 log-softmax and gradient (chunked loss: ``chunk x V``).

Parameters: fp32 master weights sharded by FSDP over dp_shard x sp (blocks also over tp),
fp32 gradients and two fp32 AdamW states alike; FSDP's unsharded working copy of two
blocks (the one computing and the one prefetched) in the compute dtype, plus their
gradients before the reduce-scatter, plus the embeddings and output layer while in use.
CPU offload moves the sharded parameters, gradients and optimizer state to host memory.
Not modelled: the CUDA context and NCCL buffers (about 1-3 GiB on an H100), allocator
fragmentation, torch.compile's workspace. ``scripts/estimate_memory.py --validate``
compares the estimate with a measured step.

Context parallelism (cp > 1, ``distributed/context_parallel.py``) adds, per layer, the keys and
values each of a rank's two chunks attends to: the prefixes of the gathered K/V that end with
the chunk, ``(2cp + 1) / 2cp`` of the sequence together: ``a r kv (2cp + 1)`` per local token in
bf16 (the flash kernel takes GQA), ``a q (2cp + 1)`` in fp32 (expanded to the q heads), kept for
backward (recomputed under full AC; selective AC keeps the all-gathered K/V they are cut
from instead, ``2 a cp r kv``); the attention working set grows by their gradients.
Parameters shard over dp_shard x cp x sp. Not modelled: the dense boolean mask of packed
documents (``S x S / cp`` bytes per layer with cp; ``B x S x S`` for any sdpa document mask).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from titan_ulysses.distributed.heads import attended_heads
from titan_ulysses.models.llama.args import LlamaArgs

GIB = 1024**3


@dataclass
class Layout:
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    cp: int = 1


@dataclass
class Switches:
    ac_mode: str = "none"
    loss_chunk_size: int = 0
    mlp_tile_size: int = 0
    cpu_offload: bool = False
    act_bytes: int = 2
    """Bytes per activation: 2 (bf16 compute) or 4 (fp32)."""


@dataclass
class Estimate:
    parameters: float
    gradients: float
    optimizer: float
    unsharded_working_params: float
    saved_activations: float
    layer_recompute: float
    attention_working_set: float
    mlp_working_set: float
    logits: float
    host_offloaded: float
    """Bytes moved to host memory (not in ``total``)."""

    @property
    def total(self) -> float:
        transient = max(self.attention_working_set, self.mlp_working_set, self.logits)
        return (self.parameters + self.gradients + self.optimizer + self.unsharded_working_params
                + self.saved_activations + self.layer_recompute + transient)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def _widths(args: LlamaArgs, layout: Layout) -> tuple[int, int, int, int, int, int, int]:
    """(D, q, kv, the attended widths qa, kva_held, kva, F) per local token.

    q, kv: the projections' widths on a tp rank. qa, kva: the q and kv widths the busiest sp
    rank attends with over the whole sequence, per local token (``heads x sp x Dh``; even
    splits: q and r kv); kva_held adds the received kv heads where a rank expands them.
    """
    q = args.n_heads * args.head_dim // layout.tp
    kv = args.n_kv_heads * args.head_dim // layout.tp
    n_q, n_kv_in, n_kv = attended_heads(args.n_heads // layout.tp, args.n_kv_heads // layout.tp, layout.sp)
    per_head = layout.sp * args.head_dim
    held = n_kv + (n_kv_in if n_kv != n_kv_in else 0)
    return args.dim, q, kv, n_q * per_head, held * per_head, n_kv * per_head, args.ffn_hidden_dim // layout.tp


def _cp_kv_per_token(args: LlamaArgs, layout: Layout, s: Switches) -> float:
    """Bytes per local token of the K/V prefixes a cp rank's two chunks attend to (see above)."""
    _, _, _, qa, _, kva, _ = _widths(args, layout)
    width = kva if s.act_bytes == 2 else qa  # bf16: flash takes GQA; fp32: expanded to the q heads
    return s.act_bytes * width * (2 * layout.cp + 1)


def layer_bytes_per_token(args: LlamaArgs, layout: Layout, s: Switches, mode: str = "none") -> float:
    """Bytes one layer keeps for backward per local token under AC ``mode``."""
    d, q, kv, qa, kva_held, kva, f = _widths(args, layout)
    a = s.act_bytes
    heads = qa // args.head_dim  # busiest rank's q heads x sp
    attention = a * (qa + 2 * kva_held) + a * qa + 4 * heads
    # the output projection's input: its own buffer after the return all-to-all; without
    # Ulysses a view of the attention output (kernels write it [B, S, H, Dh]), counted above
    wo_input = a * q if layout.sp > 1 else 0
    if layout.cp > 1:  # selective AC keeps the all-gather's output and recomputes the prefixes cut from it
        attention += a * 2 * layout.cp * kva if mode == "selective" else _cp_kv_per_token(args, layout, s)
    if mode in ("full", "full_offload"):
        return a * d if mode == "full" else 0.0
    if mode == "selective":
        return a * (q + 2 * kv) + 2 * a * d + (0 if s.mlp_tile_size else 2 * a * f) + attention + wo_input + a * d
    mlp = a * d + (0 if s.mlp_tile_size else 4 * a * f)
    norms = 2 * (a * d + 4)
    return norms + a * d + attention + wo_input + mlp


def estimate(args: LlamaArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1) -> Estimate:
    """The memory of one rank for a step of ``local_batch`` sequences of ``seq_len`` tokens."""
    s, a = switches, switches.act_bytes
    tokens = local_batch * seq_len / (layout.sp * layout.cp)  # T
    d, q, kv, qa, kva_held, _, f = _widths(args, layout)
    block = 2 * d * (q + kv) + 3 * d * f + 2 * d  # one block's parameters on a tp rank
    other = args.vocab_size * d * (1 if args.tie_embeddings else 2) + d
    shard = (args.n_layers * block + other) / (layout.dp_shard * layout.cp * layout.sp)
    states = {"parameters": 4 * shard, "gradients": 4 * shard, "optimizer": 8 * shard}
    host = 0.0
    if s.cpu_offload:
        host = sum(states.values())
        states = dict.fromkeys(states, 0.0)
    working = 2 * block * (a + 4) + other * a
    per_layer = layer_bytes_per_token(args, layout, s, s.ac_mode)
    saved = args.n_layers * per_layer * tokens + tokens * (8 + (a * d + 4) + a * d)  # + token ids, final norm, its output
    if s.ac_mode == "full_offload":
        host += args.n_layers * a * d * tokens
    recompute = 0.0 if s.ac_mode == "none" else layer_bytes_per_token(args, layout, s, "none") * tokens
    cp_kv = _cp_kv_per_token(args, layout, s) * tokens if layout.cp > 1 else 0.0  # and as much of their gradients
    attention_ws = 3 * a * (qa + 2 * kva_held) * tokens + 2 * cp_kv
    mlp_ws = 2 * a * f * (min(s.mlp_tile_size, tokens) if s.mlp_tile_size else tokens)
    logit_rows = min(s.loss_chunk_size, tokens) if s.loss_chunk_size else tokens
    logits = logit_rows * args.vocab_size * (a + 8)
    return Estimate(
        unsharded_working_params=working, saved_activations=saved, layer_recompute=recompute,
        attention_working_set=attention_ws, mlp_working_set=mlp_ws, logits=logits, host_offloaded=host, **states,
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
