"""The decoder's RMSNorm module (the op, fp32 inside, is ``ops/norm.py``)."""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.ops.norm import rms_norm


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``; Gemma's ``offset`` 1 scales by ``1 + w`` in fp32, its weights start at 0."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x):  # computed in fp32; keeps x and one fp32 scale per token (ops/norm.py)
        weight = self.weight.float() + self.offset if self.offset else self.weight
        return rms_norm(x, weight, self.eps)

    def reset_parameters(self):
        nn.init.constant_(self.weight, 1.0 - self.offset)
