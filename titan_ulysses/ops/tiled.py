"""Tiled execution along the sequence with recompute (Arctic Long Sequence Training's tiled MLP).

The SwiGLU MLP's intermediates are ``[B, S, ffn_hidden]`` -- 3.5x the residual stream for
Llama-3-8B -- and they are all alive at once in a plain forward/backward. Here the MLP
runs ``tile_size`` tokens at a time, keeps only its input, and in backward recomputes
each tile and backpropagates it, so at most one tile of intermediates exists. Numerics
equal the untiled MLP (row-wise ops only; the tiles partition the tokens).

Under ``torch.compile`` the same schedule is written as one non-reentrant checkpoint per
tile, which the compiler can trace (it cannot trace ``autograd.grad`` inside a custom
backward): each tile's forward keeps only its slice of the input, and backward recomputes
one tile at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


_forward_depth = 0


def tiled_forward_running() -> bool:
    """Whether a tiled forward is running: what it computes is never kept (selective AC asks)."""
    return _forward_depth > 0


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tile_size: int, x, *params):
        global _forward_depth
        ctx.fn, ctx.tile_size = fn, tile_size
        ctx.save_for_backward(x, *params)
        _forward_depth += 1
        try:
            with torch.no_grad():  # detached tiles: no view of a tensor that requires grad reaches the modules' hooks
                return torch.cat([fn(t) for t in x.detach().split(tile_size, dim=1)], dim=1)
        finally:
            _forward_depth -= 1

    @staticmethod
    def backward(ctx, grad_out):
        x, *params = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_params = [None] * len(params)
        for start in range(0, x.shape[1], ctx.tile_size):
            sl = slice(start, start + ctx.tile_size)
            tile = x[:, sl].detach().requires_grad_()
            with torch.enable_grad():
                out = ctx.fn(tile)
            grads = torch.autograd.grad(out, [tile, *params], grad_out[:, sl])
            grad_x[:, sl] = grads[0]
            grad_params = [g if acc is None else acc + g for acc, g in zip(grad_params, grads[1:])]
        return (None, None, grad_x, *grad_params)


def tiled_apply(module: nn.Module, fn, x: torch.Tensor, tile_size: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` using ``module``'s parameters, ``tile_size`` tokens (dim 1) at a time."""
    if tile_size <= 0 or x.shape[1] <= tile_size or not torch.is_grad_enabled():
        return fn(x)
    if torch.compiler.is_compiling():
        tiles = [checkpoint(fn, t, use_reentrant=False) for t in x.split(tile_size, dim=1)]
        return torch.cat(tiles, dim=1)
    params = [p for p in module.parameters() if p.requires_grad]
    return _TiledFunction.apply(fn, tile_size, x, *params)
