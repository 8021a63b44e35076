"""The fused linear cross-entropy (the default backend): both gradients in the forward, chunk by chunk.

For each chunk of rows, the logits ``h @ W.T`` come from one matmul in the parameter dtype; the
max, log-sum-exp and ``softmax - onehot`` (times the softcap's derivative for Gemma 2) are one pass
in fp32 over them (:func:`loss_and_grad`); then ``dH = G @ W`` in the parameter dtype and
``dW += G.T @ h`` accumulated in fp32 from parameter-dtype operands (``mm(..., out_dtype=fp32)``
on CUDA: tensor cores, never an fp32 x fp32 ``[V, D]`` GEMM). The logits are never recomputed:
backward only scales the stored ``[N, D]`` and fp32 ``[V, D]`` gradients by its incoming gradient
(the normaliser). ``planning/estimate.py`` counts what this keeps.

On CUDA the fp32 pass is a ``torch.compile``'d function (fused reductions and elementwise, no fp32
``[rows, V]`` buffer). A hand-written Triton kernel may beat it; with no GPU to measure on
(2026-11-28) the compiled function is the start, and the choice stays behind ``registry.py``. On CPU
(and on meta / fake tensors: the planner's tracker) the same function runs eagerly; where the
device has no ``out_dtype`` matmul (CPU in torch 2.13) ``dW`` takes an upcasting reference path.

No host read (no ``.item()``), no data-dependent shape: chunks where every label is ignored give
zero loss and zero gradient. Under ``no_grad`` (held-out loss) only the loss is computed; a frozen
output weight (LoRA) gets no ``dW`` work.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from titan_ulysses.ops.loss.common import chunk_rows, upcast_dtype

OUT_DTYPE_MM_DEVICES = ("cuda", "meta")
"""Devices whose ``mm`` / ``addmm`` take ``out_dtype`` (bf16 operands, fp32 output) in torch 2.13; fake
tensors (the planner's tracker) run the meta kernel on any device, so they take the CUDA path too."""


def _out_dtype_mm(t: torch.Tensor) -> bool:
    return t.device.type in OUT_DTYPE_MM_DEVICES or is_fake(t)


def loss_rows(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Per-row loss ``[r]`` (fp32 or wider; 0 on ignored rows) of ``logits: [r, V]`` against ``labels: [r]``."""
    z = logits.to(upcast_dtype(logits))
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = labels != ignore_index
    target = z.gather(1, (labels * valid)[:, None])[:, 0]
    return torch.where(valid, torch.logsumexp(z, dim=-1) - target, 0.0)


def loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, softcap: float | None,
                  grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss ``[r]``, ``d loss / d logits`` ``[r, V]`` in ``grad_dtype``), in one fp32 pass.

    In place on one fp32 copy of the logits (on CUDA compiled: fused, no fp32 buffer at all)."""
    z = logits.to(upcast_dtype(logits), copy=True)  # [r, V] fp32 (fp64 stays fp64)
    deriv = None
    if softcap:  # d(c tanh(x / c))/dx = 1 - tanh^2
        z.div_(softcap).tanh_()
        deriv = 1.0 - z * z
        z.mul_(softcap)
    valid = labels != ignore_index  # [r]
    safe = (labels * valid)[:, None]  # [r, 1] a real class where ignored (masked below)
    top = z.amax(dim=-1, keepdim=True)  # [r, 1]
    target = z.gather(1, safe)  # [r, 1]
    z.sub_(top).exp_()
    total = z.sum(dim=-1, keepdim=True)  # [r, 1]
    rows = torch.where(valid, (total.log() + top - target)[:, 0], 0.0)
    z.div_(total)  # softmax
    z.scatter_add_(1, safe, torch.full_like(target, -1.0))  # softmax - onehot
    z.mul_(valid[:, None])
    if deriv is not None:
        z.mul_(deriv)
    return rows, z.to(grad_dtype)


@functools.cache
def _compiled(grads: bool):
    """The compiled pass, made once per process on first CUDA use (compilation itself waits for the first call)."""
    return torch.compile(loss_and_grad if grads else loss_rows, fullgraph=True)


def _pass(device: torch.device, grads: bool):
    """The fp32 pass for ``device``: compiled on CUDA, eager elsewhere (CPU, meta, fake tensors)."""
    if device.type == "cuda":
        return _compiled(grads)
    return loss_and_grad if grads else loss_rows


def accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits_t: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight [V, D] += grad_logits_t [V, r] @ h [r, D]``, accumulated in ``grad_weight``'s dtype.

    Operands in the parameter dtype with an fp32 output where the device has it (tensor cores);
    on CPU, where bf16 operands have no fp32-output matmul, an upcasting reference."""
    if grad_logits_t.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits_t, h)
    elif _out_dtype_mm(grad_weight):
        torch.addmm(grad_weight, grad_logits_t, h, out_dtype=grad_weight.dtype, out=grad_weight)
    else:  # the CPU reference: fp32 operands
        grad_weight.addmm_(grad_logits_t.to(grad_weight.dtype), h.to(grad_weight.dtype))


def _loss_only(hidden, weight, labels, rows: int, ignore_index: int, softcap) -> torch.Tensor:
    """The summed loss with no gradient work (``no_grad``: the held-out loss)."""
    step = _pass(hidden.device, grads=False)
    total = torch.zeros((), dtype=upcast_dtype(hidden), device=hidden.device)
    for h, lab in zip(hidden.split(rows), labels.split(rows)):
        total += step(h @ weight.t(), lab, ignore_index, softcap).sum()  # [r, V] logits, param dtype
    return total


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum CE(softcap(hidden @ weight.T), labels); the gradients are made in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, rows: int, ignore_index: int, softcap, need_hidden: bool,
                need_weight: bool):
        # hidden [N, D], weight [V, D], labels [N]
        step = _pass(hidden.device, grads=True)
        total = torch.zeros((), dtype=upcast_dtype(hidden), device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, D], param dtype
        # a frozen output weight (LoRA) needs no [V, D] fp32 gradient
        grad_weight = torch.zeros(weight.shape, dtype=upcast_dtype(weight), device=weight.device) \
            if need_weight else None  # [V, D] fp32
        for start in range(0, hidden.shape[0], rows):
            h, lab = hidden[start: start + rows], labels[start: start + rows]  # [r, D], [r]
            loss, g = step(h @ weight.t(), lab, ignore_index, softcap, weight.dtype)  # [r], [r, V] param dtype
            total += loss.sum()
            if need_hidden:
                torch.mm(g, weight, out=grad_hidden[start: start + rows])  # [r, D] param dtype
            if need_weight:
                accumulate_weight_grad(grad_weight, g.t(), h)
            del g  # else it lives on while the next chunk's logits are computed
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.rows, ctx.weight_dtype, ctx.used = rows, weight.dtype, False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.used:
            raise RuntimeError("the fused loss scales its stored gradients in place: backward runs once "
                               "(retain_graph=True with a second backward is not supported)")
        ctx.used = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            if grad_hidden.dtype == grad_total.dtype:
                grad_hidden.mul_(grad_total)
            else:  # scale in fp32, a chunk of rows at a time (grad_total rounded to bf16 would bias it)
                for part in grad_hidden.split(ctx.rows):
                    part.copy_(part.to(grad_total.dtype) * grad_total)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   chunk_size: int, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Summed loss of ``hidden: [N, D]`` through ``weight: [V, D]`` against ``labels: [N]``."""
    rows = chunk_rows(chunk_size, hidden.shape[0], weight.shape[0], weight.shape[1])
    grad_on = torch.is_grad_enabled()
    need_hidden, need_weight = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    if not (need_hidden or need_weight):
        return _loss_only(hidden, weight, labels, rows, ignore_index, softcap)
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, rows, ignore_index, softcap,
                                          need_hidden, need_weight)
