"""RMSNorm that keeps only its input (in the compute dtype) and one fp32 scale per token.

``F.rms_norm(x.float(), ...)`` computes in fp32, as it should, but autograd then keeps the
fp32 copy of the input and the fp32 normalised input: 8 bytes per element per norm, two
norms per layer. At long context that is the largest term of a layer's recompute in
backward (Llama-3.2-1B at 1M tokens: 32 GiB, more than half of it). Here the forward
computes in fp32 the same way and keeps ``x`` as it came (2 bytes per element in bf16) and
``rstd`` (``[..., 1]``); backward recomputes the normalised input from them.
"""

from __future__ import annotations

import torch

from titan_ulysses.ops.loss import upcast


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = upcast(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        gw = g * weight.to(rstd.dtype)
        # d/dx of x * rstd(x) * w: rstd * (gw - x_hat * mean(gw * x_hat))
        grad_x = rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True))
        grad_w = (g * x_hat).flatten(0, -2).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, computed in (at least) fp32, returned in ``x.dtype``."""
    return _RMSNorm.apply(x, weight, eps)
