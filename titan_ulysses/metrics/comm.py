"""A model of Ulysses all-to-all (and context-parallel all-gather) traffic per rank, for reporting communication time apart
from measured compute (fake-process-group simulation, see docs/simulation.md)."""

from __future__ import annotations

from titan_ulysses.distributed.heads import attended_heads, exchanged_kv_heads
from titan_ulysses.models.decoder.args import DecoderArgs


def ulysses_bytes_per_step(args: DecoderArgs, seq_len: int, tokens_batch: int, sp: int, tp: int,
                           dtype_bytes: int, recompute_forward: bool, cp: int = 1) -> float:
    """Bytes one rank sends over the sp group's links in one optimizer step.

    ``tokens_batch`` is the number of sequences this rank processes per step (all
    microbatches). Per layer, the forward sends (P-1)/P of its local q, k, v (kv heads after
    replication) and of the attention output; backward sends the same volume of gradients;
    full activation checkpointing repeats the forward exchanges.
    """
    if sp == 1:
        return 0.0
    hq, hkv = args.n_heads // tp, args.n_kv_heads // tp
    hkv = exchanged_kv_heads(hq, hkv, sp)  # after replication, or each kv head to every rank that uses it
    local_tokens = tokens_batch * seq_len / (sp * cp)
    per_exchange = local_tokens * args.head_dim * dtype_bytes * (sp - 1) / sp
    forward = per_exchange * (hq + 2 * hkv) + per_exchange * hq
    passes = 3 if recompute_forward else 2  # forward, backward (+ recomputed forward)
    return args.n_layers * forward * passes


def context_parallel_bytes_per_step(args: DecoderArgs, seq_len: int, tokens_batch: int, cp: int, sp: int, tp: int,
                                    dtype_bytes: int, recompute_forward: bool) -> float:
    """Bytes one rank sends over the cp group's links in one optimizer step.

    Per layer, the forward all-gathers K and V: after Ulysses' exchange a rank holds
    ``S / cp`` tokens of ``r x Hkv / sp`` kv heads (r: Ulysses' kv replication; uneven head
    splits: the busiest rank's kv heads as attended), and a ring all-gather sends ``cp - 1`` such blocks. The backward reduce-scatters the K/V gradients
    (the same volume); full activation checkpointing repeats the forward gather.
    """
    if cp == 1:
        return 0.0
    _, _, kv_heads = attended_heads(args.n_heads // tp, args.n_kv_heads // tp, sp)  # busiest sp rank's
    local_kv = tokens_batch * seq_len / cp * 2 * kv_heads * args.head_dim * dtype_bytes
    passes = 3 if recompute_forward else 2
    return args.n_layers * (cp - 1) * local_kv * passes
