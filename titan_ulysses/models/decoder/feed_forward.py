"""The decoder's feed-forward, and the seam through which a family replaces it.

A block builds its feed-forward with its family's ``DecoderSpec.feed_forward``, a
``FeedForwardBuilder``: ``(layer_id, args, compute) -> module``. The module maps
``[B, S, D] -> [B, S, D]`` and has ``init_weights(std)``. It may instead return
``(out, stats)``: statistics that a loss pooled over every layer needs (the router's
load-balancing loss, ``models/moe/aux_loss.py``, which transformers computes from all
layers' routing counts at once, so no layer's share is known when it runs). They leave the
block beside its output, ``(h, stats)``, through activation checkpointing (groups too),
compile and FSDP, and the model sums them over layers and returns them (``return_stats=True``); the
loss adds its term once the forward is done. The default, :func:`dense`, is the gated MLP.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch.nn.functional as F
from torch import nn

from titan_ulysses.ops.tiled import tiled_apply

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}
"""The gated MLP's activations: SwiGLU's (Llama) and GeGLU's (Gemma, ``gelu_pytorch_tanh``)."""

FeedForwardBuilder = Callable[..., nn.Module]
"""``(layer_id, args: DecoderArgs, compute: ComputeOptions) -> nn.Module``."""


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, tile_size: int = 0, activation: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.tile_size = tile_size
        self.act = ACTIVATIONS[activation]

    def glu(self, x):  # [B, S, D] -> [B, S, D] via [B, S, ffn_hidden]
        return self.w2(self.act(self.w1(x)) * self.w3(x))

    def forward(self, x):
        return tiled_apply(self, self.glu, x, self.tile_size)

    def init_weights(self, std: float):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, std=std)


def dense(layer_id: int, args, compute, activation: str = "silu") -> FeedForward:
    """The default builder: the gated MLP of ``args.ffn_hidden_dim`` (``functools.partial`` picks the activation)."""
    return FeedForward(args.dim, args.ffn_hidden_dim, compute.mlp_tile_size, activation)
