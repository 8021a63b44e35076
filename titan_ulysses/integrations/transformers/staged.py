"""Head stages for ``apply_ulysses(..., head_stages=G)``: one stage's full-sequence attention tensors alive at a time.

Plain Ulysses exchanges the q/k/v of all the heads a rank attends, runs the kernel and
exchanges back: the full-sequence q, k, v and output of ``H/P`` heads (and, in backward,
their gradients and whatever the kernel saved: eager's ``[B, H/P, S, S]`` weights) exist
together. ``train.py``'s head stages (``distributed/staged_attention.py``) split that work
into G groups of heads; here transformers has already projected and roped q, k and v
(``[B, H, S/P, D]``), so a stage starts after the projections. Stage g

1. takes the q heads stage g gives every rank (``stage_plans``: the heads plain Ulysses gives
   rank r, even or uneven, in G balanced contiguous groups) and the kv heads they use,
2. exchanges, runs the model's own kernel on the full sequence with the full-sequence mask
   and exchanges back (``staged_attention.exchange_stage``, the exchange ``train.py`` uses),
3. and its output heads go back into their slots of ``[B, S/P, H, D]``.

Each stage is a non-reentrant ``torch.utils.checkpoint`` of its own: forward keeps only the
local q/k/v (shared by all stages) and each stage's local output; backward recomputes one
stage and runs its backward before the next. So at any time one stage's full-sequence
tensors exist, ``1/G`` of one layer's under plain Ulysses for equal stages (a kv head that
one stage's q heads share is resent in each stage: that part does not shrink), while plain
Ulysses keeps every layer's until backward reaches it. Attention sinks (``s_aux``, one logit
per q head) are split with the q heads. Nested under ``gradient_checkpointing_enable`` and
``fully_shard`` they need nothing else: the checkpoints nest.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from titan_ulysses.distributed.staged_attention import StagePlan, check_head_stages, exchange_stage, stage_plans
from titan_ulysses.distributed.ulysses import UlyssesAttention

__all__ = ["HeadStages", "check_stages"]


def check_stages(stages, n_heads: int, n_kv_heads: int, sp: int) -> None:
    """Refuse a ``head_stages`` the heads cannot take, in one line naming the option and the counts that work."""
    check_head_stages(stages, n_heads, n_kv_heads, sp, setting="apply_ulysses: head_stages", degree="sp")


def _heads(x: torch.Tensor, ranges) -> torch.Tensor:
    """The heads ``ranges`` of ``x`` [B, S/P, H, D], in order: [B, S/P, sum of the ranges, D]."""
    parts = [x[:, :, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _stage(exchange: UlyssesAttention, plan: StagePlan, q, k, v, sinks, *args):
    """One stage: its heads of every rank exchanged, attended and exchanged back: [B, S/P, P*h, D] in rank order."""
    if sinks is not None:  # one logit per q head: this rank's heads of this stage
        a, b = plan.q[exchange.rank]
        sinks = sinks[a:b]
    return exchange_stage(exchange, plan, _heads(q, plan.q), _heads(k, plan.kv), _heads(v, plan.kv), *args,
                          sinks=sinks)


class HeadStages:
    """Stands in for ``UlyssesAttention`` in the registered attention function: the same call, in G stages."""

    def __init__(self, exchange: UlyssesAttention, stages: int):
        self.exchange = exchange
        self.stages = stages
        self._checked: set[tuple[int, int]] = set()

    def __call__(self, q, k, v, *args, sinks=None):
        # q: [B, S/P, Hq, D], k/v: [B, S/P, Hkv, D] -> [B, S/P, Hq, D]
        sp = self.exchange.sp
        hq, hkv = q.shape[2], k.shape[2]
        if (hq, hkv) not in self._checked:  # a layer whose heads differ from the config's
            check_stages(self.stages, hq, hkv, sp)
            self._checked.add((hq, hkv))
        plans = stage_plans(hq, hkv, sp, self.stages)
        outs = [checkpoint(_stage, self.exchange, plan, q, k, v, sinks, *args, use_reentrant=False)
                for plan in plans]  # each [B, S/P, P*h_g, D]
        parts, offsets = [], [0] * len(plans)
        for r in range(sp):  # rank r's heads are contiguous, its stages in order within them
            for g, plan in enumerate(plans):
                n = plan.q_counts[r]
                parts.append(outs[g][:, :, offsets[g]:offsets[g] + n])
                offsets[g] += n
        return torch.cat(parts, dim=2)  # [B, S/P, Hq, D]
