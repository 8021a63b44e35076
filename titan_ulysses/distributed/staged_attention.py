"""Head-staged Ulysses: attention in stages of head groups, one stage's full-sequence tensors alive at a time.

Plain Ulysses projects q, k and v for every local head, exchanges them, attends, exchanges
back and projects out: the full-sequence q/k/v/out of all ``H/P`` heads a rank attends, and
their gradients, are alive together. With ``parallelism.ulysses_head_stages = G`` every rank's
heads are split into G groups and the attention layer runs G stages; stage g

1. projects the q, k, v of group g only (rows of the q/k/v projections)   ``[B, S/P, P*h, Dh]``
2. exchanges them (one all-to-all, q/k/v together)                         ``[B, S, h, Dh]``
3. attends over the full sequence                                          ``[B, S, h, Dh]``
4. exchanges the output back                                               ``[B, S/P, P*h, Dh]``
5. adds its share of the output projection (its columns)                   ``[B, S/P, D]``

Each stage is an activation checkpoint of its own (it keeps only its input and, with
``parallelism.ulysses_stage_keep_attention``, its attention kernel's outputs: ``stage_keep.py``;
backward recomputes the stage, then runs its backward), so forward and backward both hold one
stage's full-sequence q/k/v/out and their gradients at a time: ``1/G`` of plain Ulysses'
attention working set. The sum of the stages equals the plain layer (same heads, same kv
heads per q head; only the output projection's summation order differs).

Which heads: rank r's q heads are the ones plain Ulysses gives it (``heads.py``: even or
uneven), split into G balanced contiguous groups; a stage sends each rank the kv heads its
group uses, so a kv head shared by two stages (GQA groups larger than a stage) is projected
and exchanged once per stage, and autograd sums its gradient. ``sp = 1`` stages the heads of
one process (no exchange): the same memory saving on a single GPU.

Nothing here changes parameter names: the attention module's class is swapped for a
subclass whose ``forward`` runs the stages over the module's own projections. What it uses of
the module is the contract its class derives from, ``ops/attention/contracts.HeadAttention``
(its projections, ``prepare_qk``, ``inner_attention``, ``attention_kwargs``, ``head_dim``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_ulysses.distributed.heads import HeadPlan, head_plan, is_even
from titan_ulysses.distributed.stage_keep import compiled_stage_contexts, stage_contexts
from titan_ulysses.distributed.ulysses import UlyssesAttention, head_to_seq, head_to_seq_uneven, seq_to_head, \
    seq_to_head_uneven
from titan_ulysses.ops.attention.contracts import HeadAttention

__all__ = ["StagePlan", "apply_head_stages", "attend_stage", "check_head_stages", "exchange_stage", "stage_plans"]


def _balanced(a: int, b: int, parts: int) -> list[tuple[int, int]]:
    """[a, b) in ``parts`` contiguous ranges whose sizes differ by at most one, larger first."""
    n = b - a
    sizes = [n // parts + (1 if i < n % parts else 0) for i in range(parts)]
    starts = [a + sum(sizes[:i]) for i in range(parts)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def rank_q_ranges(n_heads: int, n_kv_heads: int, sp: int) -> list[tuple[int, int]]:
    """Each rank's q heads under plain Ulysses (``[start, end)`` of the local heads)."""
    if is_even(n_heads, n_kv_heads, sp):
        n = n_heads // sp
        return [(r * n, (r + 1) * n) for r in range(sp)]
    return list(head_plan(n_heads, n_kv_heads, sp).q)


def check_head_stages(stages: int, n_heads: int, n_kv_heads: int, sp: int, tp: int = 1,
                      setting: str = "parallelism.ulysses_head_stages", degree: str = "ulysses_degree") -> None:
    """Refuse a stage count the heads cannot take, in one line naming ``setting`` (``degree``: the sp degree's name).

    Every stage gives every rank at least one q head; with an even head split the stages must
    divide the heads per rank (equal stages, one equal-block all-to-all each)."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"{setting} must be an integer >= 1 (1 = off), got {stages!r}")
    if stages == 1:
        return
    if tp > 1:
        raise ValueError(f"{setting} {stages} does not combine with tensor_parallel_degree {tp} "
                         f"(the stages slice the projections themselves); use {setting.rsplit('.', 1)[-1]} = 1 with tp")
    hq, hkv = n_heads // tp, n_kv_heads // tp
    counts = [b - a for a, b in rank_q_ranges(hq, hkv, sp)]
    fewest = min(counts)
    if stages > fewest:
        raise ValueError(f"{setting} {stages} is more than the {fewest} q heads a rank attends "
                         f"({hq} heads over {degree} {sp}); use at most {fewest}")
    if len(set(counts)) == 1 and fewest % stages:
        good = [g for g in range(1, fewest + 1) if fewest % g == 0]
        raise ValueError(f"{setting} {stages} does not divide the {fewest} q heads per rank "
                         f"({hq} heads over {degree} {sp}); use one of {good}")


@dataclass(frozen=True)
class StagePlan(HeadPlan):
    """One stage: which q and kv heads every rank attends in it (``HeadPlan``'s ranges, of the tp-local heads,
    in rank order; here they cover only this stage's heads, and two stages' kv ranges may overlap)."""

    @property
    def even(self) -> bool:
        """Every rank gets as many q heads and kv heads: the equal-block exchange."""
        return len(set(self.q_counts)) == 1 and len(set(self.kv_counts)) == 1

    def exchange_plan(self) -> HeadPlan:
        """The ranges into this stage's own projected q and kv (concatenated in rank order), for the uneven exchange."""
        def packed(ranges):
            starts = [0]
            for a, b in ranges:
                starts.append(starts[-1] + b - a)
            return tuple(zip(starts[:-1], starts[1:]))
        return HeadPlan(q=packed(self.q), kv=packed(self.kv), group=self.group)


@functools.lru_cache(maxsize=None)
def stage_plans(n_heads: int, n_kv_heads: int, sp: int, stages: int) -> tuple[StagePlan, ...]:
    """The ``stages`` stages of ``n_heads`` q heads (``n_kv_heads`` kv heads) over ``sp`` ranks."""
    group = n_heads // n_kv_heads
    per_rank = [_balanced(a, b, stages) for a, b in rank_q_ranges(n_heads, n_kv_heads, sp)]
    plans = []
    for g in range(stages):
        q = tuple(ranges[g] for ranges in per_rank)
        kv = tuple((a // group, (b - 1) // group + 1) for a, b in q)
        plans.append(StagePlan(q=q, kv=kv, group=group))
    return tuple(plans)


def _select(w: torch.Tensor | None, ranges, head_dim: int, dim: int) -> torch.Tensor | None:
    """The heads ``ranges`` (in order) of a projection weight/bias along ``dim`` (0: q/k/v rows, 1: o's columns).

    A regular pattern (equal ranges at one stride that tiles the heads) is one strided view;
    anything else concatenates the slices."""
    if w is None:
        return None
    heads = w.shape[dim] // head_dim
    lengths = {b - a for a, b in ranges}
    stride = ranges[1][0] - ranges[0][0] if len(ranges) > 1 else heads
    if (len(lengths) == 1 and stride > 0 and heads == stride * len(ranges)
            and all(a == ranges[0][0] + r * stride for r, (a, _) in enumerate(ranges))):
        a0, n = ranges[0][0], lengths.pop()
        if dim == 0:  # [H*Dh, ...] -> [P, stride, Dh, ...] -> the n heads at a0 of each block
            blocks = w.unflatten(0, (len(ranges), stride, head_dim))[:, a0:a0 + n]
            return blocks.flatten(0, 2)
        blocks = w.unflatten(1, (len(ranges), stride, head_dim))[:, :, a0:a0 + n]  # [D, P, n, Dh]
        return blocks.flatten(1, 3)
    parts = [w.narrow(dim, a * head_dim, (b - a) * head_dim) for a, b in ranges]
    return torch.cat(parts, dim=dim)


class HeadStagedAttention:
    """Mixin put in front of an attention module's class by :func:`apply_head_stages`."""

    head_stages: int = 1
    stage_keep_attention: bool = True

    def forward(self, x, rope, attention_mask=None):  # [B, S/P, D] -> [B, S/P, D]
        proj = self.projections()
        for p in proj:
            if type(p) is not nn.Linear:  # LoRA / float8 / TP modules have their own forward; no silent bypass
                raise ValueError(f"parallelism.ulysses_head_stages > 1 needs plain nn.Linear projections, found "
                                 f"{type(p).__name__}; set ulysses_head_stages = 1 with LoRA, float8 or tensor "
                                 f"parallelism")
        inner = self.inner_attention
        sp = inner.sp if isinstance(inner, UlyssesAttention) else 1
        hq = proj.q.weight.shape[0] // self.head_dim
        hkv = proj.k.weight.shape[0] // self.head_dim
        plans = stage_plans(hq, hkv, sp, self.head_stages)
        if sp > 1:
            inner._check_slice(x)
        out = None
        for g, plan in enumerate(plans):
            keep = {}
            if self.stage_keep_attention:  # compiled: nothing per layer in the frame (no per-layer guard)
                keep["context_fn"] = (compiled_stage_contexts if torch.compiler.is_compiling()
                                      else functools.partial(stage_contexts, self, g))
            part = checkpoint(_run_stage, self, x, rope[0], rope[1], attention_mask, plan,
                              use_reentrant=False, preserve_rng_state=False, **keep)  # [B, S/P, D]
            out = part if out is None else out + part  # [B, S/P, D]
        return out if proj.o.bias is None else out + proj.o.bias  # once, not once per stage

    def _stage(self, x, cos, sin, attention_mask, plan: StagePlan):
        b, s, _ = x.shape
        dh = self.head_dim
        proj = self.projections()
        q = F.linear(x, _select(proj.q.weight, plan.q, dh, 0), _select(proj.q.bias, plan.q, dh, 0))
        k = F.linear(x, _select(proj.k.weight, plan.kv, dh, 0), _select(proj.k.bias, plan.kv, dh, 0))
        v = F.linear(x, _select(proj.v.weight, plan.kv, dh, 0), _select(proj.v.bias, plan.kv, dh, 0))
        q, k, v = (t.view(b, s, -1, dh) for t in (q, k, v))  # [B, S/P, P*h, Dh], [B, S/P, P*c, Dh]
        q, k = self.prepare_qk(q, k, (cos, sin))
        inner = self.inner_attention
        kwargs = self.attention_kwargs
        if isinstance(inner, UlyssesAttention):
            out = exchange_stage(inner, plan, q, k, v, attention_mask, **kwargs)  # [B, S/P, P*h, Dh]
        else:
            out = attend_stage(inner, plan, 0, q, k, v, attention_mask, **kwargs)
        return F.linear(out.flatten(2), _select(proj.o.weight, plan.q, dh, 1))  # [B, S/P, D]



def attend_stage(local, plan: StagePlan, rank: int, q, k, v, *args, **kwargs):
    """``local(q, k, v, *args, **kwargs)`` on rank ``rank``'s heads of a stage, its kv heads expanded to one per
    q head where they do not form even GQA groups. q: [B, S, h_r, Dh], k/v: [B, S, c_r, Dh]."""
    index = plan.kv_index(rank)
    if index is not None:  # q heads straddling kv groups unevenly: one kv head per q head
        idx = torch.tensor(index, device=k.device)
        k, v = k.index_select(2, idx), v.index_select(2, idx)
    return local(q, k, v, *args, **kwargs)


def exchange_stage(inner: UlyssesAttention, plan: StagePlan, q, k, v, *args, **kwargs):
    """One stage through ``inner``'s group: exchange, ``inner.local_attention``, exchange back.

    q: [B, S/P, P*h, Dh] and k/v: [B, S/P, P*c, Dh], the stage's heads of every rank in rank
    order (``plan.q`` / ``plan.kv``) -> [B, S/P, P*h, Dh] in the same order. Also the
    transformers integration's stages (``integrations/transformers/staged.py``)."""
    if plan.even:
        q, k, v = seq_to_head([q, k, v], inner.group, inner.sp)  # [B, S, h, Dh]
        out = attend_stage(inner.local_attention, plan, inner.rank, q, k, v, *args, **kwargs)
        return head_to_seq(out, inner.group, inner.sp)  # [B, S/P, P*h, Dh]
    packed = plan.exchange_plan()
    q, k, v = seq_to_head_uneven(q, k, v, packed, inner.group, inner.rank)  # [B, S, h_r, Dh]
    out = attend_stage(inner.local_attention, plan, inner.rank, q, k, v, *args, **kwargs)
    return head_to_seq_uneven(out, packed, inner.group)


def _run_stage(module, x, cos, sin, attention_mask, plan):
    """A stage through a free function: a bound method given to checkpoint makes dynamo guard on the
    module's identity (one recompile per layer; 32 layers pass the recompile limit under fullgraph)."""
    return module._stage(x, cos, sin, attention_mask, plan)


@functools.lru_cache(maxsize=None)
def _staged_class(cls: type) -> type:
    return type(f"HeadStaged{cls.__name__}", (HeadStagedAttention, cls), {})


def apply_head_stages(model: nn.Module, stages: int, keep_attention: bool = True) -> int:
    """Run every attention module (a ``HeadAttention``) in ``stages`` head stages.

    Apply after Ulysses (the stages use its group) and before activation checkpointing and
    compile. Returns how many modules were staged (0 when ``stages`` is 1)."""
    if stages == 1:
        return 0
    staged = 0
    for module in model.modules():
        if isinstance(module, HeadStagedAttention):
            continue
        if isinstance(module, HeadAttention):
            module.__class__ = _staged_class(type(module))
            module.head_stages = stages
            module.stage_keep_attention = keep_attention
            staged += 1
    if staged == 0:
        raise ValueError("parallelism.ulysses_head_stages found no attention module deriving from ops/attention/"
                         "contracts.HeadAttention to stage in the model; use ulysses_head_stages = 1")
    return staged
