"""The decoder's feed-forward: the gated MLP (SwiGLU), optionally tiled along the sequence (``ops/tiled.py``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from titan_ulysses.ops.tiled import tiled_apply


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, tile_size: int = 0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.tile_size = tile_size

    def swiglu(self, x):  # [B, S, D] -> [B, S, D] via [B, S, ffn_hidden]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x):
        return tiled_apply(self, self.swiglu, x, self.tile_size)

    def init_weights(self, std: float):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, std=std)
