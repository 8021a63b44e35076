"""Token-level cross-entropy, summed, so callers choose the normaliser (the global token count).

At long sequence lengths the logits are the largest activation of the step: for
Llama-3 (vocab 128256) a 128K-token slice has 64 GiB of fp32 logits. The chunked path
computes the loss ``chunk_size`` tokens at a time and recomputes each chunk's logits in
backward, so at most ``[chunk_size, vocab]`` logits exist at once (in fp32, twice: the
upcast logits and their softmax; backward also holds an fp32 ``[vocab, D]`` gradient of
the output weight -- ``planning/estimate.py`` counts them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def upcast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype :func:`upcast` gives ``t``, without making the copy (a ``[T, D]`` fp32 transient)."""
    return torch.promote_types(t.dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16 logits lose the loss; fp64 stays fp64)."""
    return t.to(upcast_dtype(t))


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of per-token losses of ``logits: [B, S, V]`` against ``labels: [B, S]`` in fp32."""
    return F.cross_entropy(
        upcast(logits.flatten(0, 1)), labels.flatten(), ignore_index=ignore_index, reduction="sum"
    )


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


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
    chunk_size: int = 0, ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Summed CE of the output projection ``hidden: [B, S, D] @ weight.T: [V, D]`` against ``labels: [B, S]``.

    ``chunk_size`` 0 materialises all logits (fastest at short lengths); > 0 bounds them
    to ``[chunk_size, V]`` in forward and backward.
    """
    if chunk_size <= 0:
        return cross_entropy_sum(F.linear(hidden, weight), labels, ignore_index)
    return _ChunkedLinearCrossEntropy.apply(
        hidden.flatten(0, 1), weight, labels.flatten(), chunk_size, ignore_index
    )
