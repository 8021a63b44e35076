"""RMSNorm that keeps only its input (in the compute dtype) and one fp32 scale per token.

``F.rms_norm(x.float(), ...)`` computes in fp32, as it should, but autograd then keeps the
fp32 copy of the input and the fp32 normalised input: 8 bytes per element per norm, two
norms per layer. At long context that is the largest term of a layer's recompute in
backward (Llama-3.2-1B at 1M tokens: 32 GiB, more than half of it). Here the forward
computes in fp32 the same way and keeps ``x`` as it came (2 bytes per element in bf16) and
``rstd`` (``[..., 1]``); backward recomputes the normalised input from them.

In eager mode both passes run ``CHUNK_TOKENS`` tokens at a time: the fp32 temporaries (the
upcast input, the normalised input, the scaled gradient: five ``[T, D]`` fp32 tensors in
backward) would otherwise be the largest transient of a long-context step -- 40 GiB for
the 1B shape at 1M tokens. Every token's numbers are the same; only the weight gradient's
sum over tokens is taken chunk by chunk (in fp32). Compiled code takes one chunk: inductor
fuses the norm into a kernel without those temporaries.
"""

from __future__ import annotations

import torch

from titan_ulysses.ops.loss import upcast, upcast_dtype


CHUNK_TOKENS = 4096


def _chunks(n: int) -> list[tuple[int, int]]:
    step = n if torch.compiler.is_compiling() else CHUNK_TOKENS
    return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        rows = x.reshape(-1, x.shape[-1])  # [T, D]
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], 1, dtype=upcast_dtype(x), device=x.device)  # [T, 1]
        w = weight.to(rstd.dtype)
        for a, b in _chunks(rows.shape[0]):
            xf = upcast(rows[a:b])
            rstd[a:b] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            out[a:b] = (xf * rstd[a:b] * w).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd.view(*x.shape[:-1], 1))  # [..., 1]
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        rstd = rstd.reshape(-1, 1)  # [T, 1]
        rows, grows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])  # [T, D]
        grad_x = torch.empty_like(rows)
        grad_w = torch.zeros(weight.shape, dtype=rstd.dtype, device=x.device)
        w = weight.to(rstd.dtype)
        for a, b in _chunks(rows.shape[0]):
            x_hat = rows[a:b].to(rstd.dtype) * rstd[a:b]
            g = grows[a:b].to(rstd.dtype)
            gw = g * w
            # d/dx of x * rstd(x) * w: rstd * (gw - x_hat * mean(gw * x_hat))
            grad_x[a:b] = (rstd[a:b] * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))).to(x.dtype)
            grad_w += (g * x_hat).sum(0)
        return grad_x.view(x.shape), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in (at least) fp32, returned in ``x.dtype``."""
    return _RMSNorm.apply(x, weight, eps)
