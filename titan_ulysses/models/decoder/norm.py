"""The decoder's RMSNorm module (the op is ``ops/norm.py``)."""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # computed in fp32; keeps x and one fp32 scale per token (ops/norm.py)
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self):
        nn.init.ones_(self.weight)
