"""The chunked linear cross-entropy (the default until 2026-11-28, kept for A/B): logits recomputed in backward.

Forward computes the loss ``rows`` tokens at a time; backward recomputes each chunk's logits, so at
most ``[rows, V]`` logits exist at once (fp32, twice: the upcast logits and their softmax), beside
an fp32 ``[V, D]`` output-weight gradient accumulated by an fp32 x fp32 GEMM. The ``fused`` backend
replaces it: it computes the gradients once, in forward, through tensor cores. No final logit softcap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_ulysses.ops.loss.common import chunk_rows, upcast, upcast_dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum CE(hidden @ weight.T, labels) over chunks of tokens, logits recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size: int, ignore_index: int):
        # hidden [N, D], weight [V, D], labels [N]
        total = torch.zeros((), dtype=upcast_dtype(hidden), device=hidden.device)
        for h, lab in zip(hidden.split(chunk_size), labels.split(chunk_size)):
            logits = upcast(h @ weight.t())  # [chunk, V]
            total += F.cross_entropy(logits, lab, ignore_index=ignore_index, reduction="sum")
            del logits  # else it lives on while the next chunk's logits are computed
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # a frozen output weight (LoRA) needs no [V, D] fp32 gradient
        need_weight = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=upcast_dtype(weight), device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[start : start + ctx.chunk_size]
            lab = labels[start : start + ctx.chunk_size]
            # d(sum CE)/d logits = softmax - one_hot(label), zero on ignored tokens
            grad_logits = torch.softmax(upcast(h @ weight.t()), dim=-1)  # [chunk, V]
            valid = lab != ctx.ignore_index
            # -1 at each valid label; a scatter rather than boolean indexing: static shapes (no host
            # sync on CUDA; FakeTensorMode can run it, see scripts/estimate_memory.py --track)
            grad_logits.scatter_add_(1, (lab * valid)[:, None], -valid[:, None].to(grad_logits.dtype))
            grad_logits *= valid[:, None] * grad_total
            grad_hidden[start : start + ctx.chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), upcast(h))  # in place: no second [V, D] fp32 buffer
            del grad_logits  # else it lives on while the next chunk's softmax is computed: 4 x chunk x V bytes
        return grad_hidden, grad_weight.to(weight.dtype) if need_weight else None, None, None, None


def chunked_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     chunk_size: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Summed loss of ``hidden: [N, D]`` through ``weight: [V, D]`` against ``labels: [N]``."""
    rows = chunk_rows(chunk_size, hidden.shape[0], weight.shape[0], weight.shape[1])
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, rows, ignore_index)
