"""Ulysses sequence parallelism: the all-to-all exchanges and the attention wrapper.

Each of the P ranks of the ``sp`` mesh holds a contiguous slice of every sequence.
Attention needs the whole sequence, so before it one all-to-all turns

    [B, S/P, H, D]  (my tokens, all heads)   into   [B, S, H/P, D]  (all tokens, my heads)

and after it a second all-to-all turns the output back. q, k and v travel in one
collective. Both exchanges are differentiable (the backward of an all-to-all is the
all-to-all in the other direction) and are built on PyTorch's functional collectives,
so ``torch.compile(fullgraph=True)`` traces them without a graph break.

GQA: when the (tensor-parallel-local) kv head count is smaller than P and divides it,
kv heads are replicated up to P before the exchange, so that the SP degree is not
capped by the number of kv heads. Autograd sums the gradients of the replicas.

Head counts P does not divide (Qwen2.5-7B's 28 heads at P=8, 16 heads at P=3) take the
uneven exchange: ranks get head counts that differ by one, and each receives the kv heads
its q heads use (``heads.py`` says which); the all-to-all then has split sizes, still one
functional collective each way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.distributed.heads import HeadPlan, check_heads, head_plan, is_even, kv_replication_factor

__all__ = ["UlyssesAttention", "apply_ulysses", "check_heads", "head_to_seq", "kv_replication_factor", "seq_to_head",
           "seq_to_head_uneven", "head_to_seq_uneven"]


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal blocks of dim 0: block i goes to rank i, block j of the result came from rank j."""
    return funcol.all_to_all_single_autograd(x, None, None, group)


def seq_to_head(
    tensors: list[torch.Tensor], group, sp: int
) -> list[torch.Tensor]:
    """[B, S/P, H_i, D] each -> [B, S, H_i/P, D] each, in one all-to-all."""
    b, s_local, _, d = tensors[0].shape
    heads = [t.shape[2] // sp for t in tensors]
    # [B, S/P, P, H_i/P, D] -> concatenated per destination rank: [B, S/P, P, sum(H_i)/P, D]
    packed = torch.cat(
        [t.reshape(b, s_local, sp, h, d) for t, h in zip(tensors, heads)], dim=3
    )
    packed = packed.permute(2, 0, 1, 3, 4).contiguous()  # [P(dst), B, S/P, sum/P, D]
    received = _all_to_all(packed, group)  # [P(src = sequence chunk), B, S/P, sum/P, D]
    full = received.permute(1, 0, 2, 3, 4).reshape(b, sp * s_local, sum(heads), d)
    return list(full.split(heads, dim=2))  # [B, S, H_i/P, D]


def head_to_seq(x: torch.Tensor, group, sp: int) -> torch.Tensor:
    """[B, S, H/P, D] -> [B, S/P, H, D]."""
    b, s, h_local, d = x.shape
    s_local = s // sp
    x = x.reshape(b, sp, s_local, h_local, d).permute(1, 0, 2, 3, 4).contiguous()  # [P(dst), B, S/P, H/P, D]
    received = _all_to_all(x, group)  # [P(src = head group), B, S/P, H/P, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, s_local, sp * h_local, d)


def seq_to_head_uneven(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: HeadPlan, group, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, S/P, H, D] -> [B, S, H_r, D] for q, k and v, where rank r's heads are ``plan.q[r]`` / ``plan.kv[r]``.

    Every rank sends rank r its tokens of r's heads (a kv head that two ranks use goes to
    both), so the input splits differ per destination and the output splits are equal.
    """
    b, s_local, _, d = q.shape
    sp = len(plan.q)
    per_head = b * s_local * d
    chunks = []  # one flat block per destination: [B, S/P, nq_r + 2 nkv_r, D]
    for (a, e), (ka, kb) in zip(plan.q, plan.kv):
        chunks.append(torch.cat([q[:, :, a:e], k[:, :, ka:kb], v[:, :, ka:kb]], dim=2).reshape(-1))
    sizes = [(nq + 2 * nkv) * per_head for nq, nkv in zip(plan.q_counts, plan.kv_counts)]
    n_q, n_kv = plan.q_counts[rank], plan.kv_counts[rank]
    mine = n_q + 2 * n_kv
    received = funcol.all_to_all_single_autograd(torch.cat(chunks), [mine * per_head] * sp, sizes, group)
    full = received.view(sp, b, s_local, mine, d).permute(1, 0, 2, 3, 4).reshape(b, sp * s_local, mine, d)
    q, k, v = full.split([n_q, n_kv, n_kv], dim=2)  # [B, S, n_q | n_kv | n_kv, D]
    return q, k, v


def head_to_seq_uneven(x: torch.Tensor, plan: HeadPlan, group) -> torch.Tensor:
    """[B, S, H_r, D] (rank r's heads) -> [B, S/P, H, D]: equal input splits, output splits by the senders' heads."""
    b, s, h_local, d = x.shape
    sp = len(plan.q)
    s_local = s // sp
    x = x.reshape(b, sp, s_local, h_local, d).permute(1, 0, 2, 3, 4).reshape(-1)  # [P(dst), B, S/P, H_r, D]
    per_head = b * s_local * d
    received = funcol.all_to_all_single_autograd(
        x, [n * per_head for n in plan.q_counts], [h_local * per_head] * sp, group
    )
    blocks = received.split([n * per_head for n in plan.q_counts])  # from rank j: [B, S/P, H_j, D]
    return torch.cat([blk.view(b, s_local, n, d) for blk, n in zip(blocks, plan.q_counts)], dim=2)


class UlyssesAttention(nn.Module):
    """Wraps any local attention ``fn(q, k, v, *args, **kwargs) -> out`` with the Ulysses exchanges.

    Inputs are the local sequence slice with all (tensor-parallel-local) heads,
    ``q: [B, S/P, Hq, D]``, ``k, v: [B, S/P, Hkv, D]``; the output is ``[B, S/P, Hq, D]``.
    Every rank of the group must hold the same number of tokens: shard sequences with
    :func:`titan_ulysses.data.sharding.shard_for_sp`, which pads S up to a multiple of P
    at the end, where causal attention keeps padding out of every real token's view.
    Any further arguments (``attention_mask``, or torchtitan's ``attention_masks=``,
    ``scale=``, ...) are passed to the local attention unchanged: a mask must describe the
    full sequence (see ``ops.attention.build_attention_mask``), since that is what the
    local attention sees.
    """

    check_slices = True
    """Check in eager mode that every rank holds as many tokens (one all_gather of an int per call;
    compiled code skips it; ``apply_ulysses`` leaves it on for the first layer only). Unequal slices would otherwise abort the process inside gloo (or
    hang NCCL) with no hint of the cause."""

    def __init__(self, local_attention: nn.Module, sp_mesh: DeviceMesh):
        super().__init__()
        if sp_mesh.ndim != 1:
            raise ValueError(f"UlyssesAttention needs a 1-D sp mesh, got {sp_mesh.ndim} dims")
        self.local_attention = local_attention
        self.sp = sp_mesh.size()
        self.rank = sp_mesh.get_local_rank()
        self.group = sp_mesh.get_group()
        self._kv_index: torch.Tensor | None = None  # uneven splits: this rank's kv head per q head
        self._can_check = self.sp > 1 and dist.get_backend(self.group) != "fake"  # fake collectives return nothing

    def _check_slice(self, q: torch.Tensor) -> None:
        """Raise ValueError on every rank if the sp ranks' slices differ in length."""
        if torch.compiler.is_compiling() or not (self.check_slices and self._can_check):  # compiled: no per-layer guard
            return
        mine = torch.tensor([q.shape[1]], dtype=torch.int64, device=q.device)
        gathered = [torch.empty_like(mine) for _ in range(self.sp)]
        dist.all_gather(gathered, mine, group=self.group)
        lengths = [int(x) for x in gathered]
        if len(set(lengths)) > 1:
            raise ValueError(
                f"UlyssesAttention: the {self.sp} ranks of the sp group hold sequence slices of lengths "
                f"{lengths}; every rank must hold S/ulysses_degree tokens. Pad the sequence to a multiple of "
                f"ulysses_degree before splitting it (titan_ulysses.data.sharding.shard_for_sp does)"
            )

    def forward(self, q, k, v, *args, **kwargs):
        if self.sp == 1:
            return self.local_attention(q, k, v, *args, **kwargs)
        self._check_slice(q)
        if not is_even(q.shape[2], k.shape[2], self.sp):
            return self._uneven(q, k, v, *args, **kwargs)
        rep = kv_replication_factor(q.shape[2], k.shape[2], self.sp)
        if rep > 1:
            # kv head j serves q heads of ranks j*rep ... j*rep+rep-1: after the exchange
            # rank r holds exactly the kv head its q heads use.
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        if kwargs.get("sinks") is not None:  # one logit per q head: this rank's heads after the exchange
            n = q.shape[2] // self.sp
            kwargs = {**kwargs, "sinks": kwargs["sinks"][self.rank * n:(self.rank + 1) * n]}
        q, k, v = seq_to_head([q, k, v], self.group, self.sp)  # [B, S, H/P, D]
        out = self.local_attention(q, k, v, *args, **kwargs)  # [B, S, Hq/P, D]
        return head_to_seq(out, self.group, self.sp)  # [B, S/P, Hq, D]

    def _uneven(self, q, k, v, *args, **kwargs):
        plan = head_plan(q.shape[2], k.shape[2], self.sp)
        if kwargs.get("sinks") is not None:
            a, e = plan.q[self.rank]
            kwargs = {**kwargs, "sinks": kwargs["sinks"][a:e]}
        q, k, v = seq_to_head_uneven(q, k, v, plan, self.group, self.rank)  # [B, S, H_r, D]
        index = plan.kv_index(self.rank)
        if index is not None:  # q heads that straddle kv groups unevenly: one kv head per q head
            if self._kv_index is None or self._kv_index.device != k.device:  # built once, not per step
                self._kv_index = torch.tensor(index, device=k.device)
            k, v = k.index_select(2, self._kv_index), v.index_select(2, self._kv_index)
        out = self.local_attention(q, k, v, *args, **kwargs)  # [B, S, Hq_r, D]
        return head_to_seq_uneven(out, plan, self.group)  # [B, S/P, Hq, D]

    def extra_repr(self) -> str:
        return f"sp={self.sp}"


def apply_ulysses(model: nn.Module, sp_mesh: DeviceMesh) -> int:
    """Wrap the ``inner_attention`` of every attention module in ``UlyssesAttention``.

    Returns how many were wrapped. The model only has to expose its local attention
    as an ``inner_attention`` submodule taking ``(q, k, v, attention_mask)``.
    """
    wrapped = 0
    for module in list(model.modules()):
        inner = getattr(module, "inner_attention", None)
        if isinstance(inner, nn.Module) and not isinstance(inner, UlyssesAttention):
            module.inner_attention = UlyssesAttention(inner, sp_mesh)
            # every layer sees the same slice length: the first layer's check (one all_gather
            # and a host sync per forward) catches a mismatch; repeating it per layer would
            # put a sync in front of every attention of the step
            module.inner_attention.check_slices = wrapped == 0
            wrapped += 1
    if wrapped == 0:
        raise ValueError("apply_ulysses found no `inner_attention` module to wrap in the model")
    return wrapped


def stop_slice_checks(model: nn.Module) -> None:
    """Turn :attr:`UlyssesAttention.check_slices` off everywhere in ``model``: for a caller whose
    slices keep one shape once checked (the trainer, after its first step), the check would
    be a host sync per forward that can no longer fail."""
    for module in model.modules():
        if isinstance(module, UlyssesAttention):
            module.check_slices = False
