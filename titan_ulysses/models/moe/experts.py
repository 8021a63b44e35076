"""Experts as grouped matrix products over token rows sorted by expert (``ops/grouped_mm.py``).

Weights are stored per projection as ``[E, in, out]`` (``x @ W``), the layout the grouped
kernel takes: ``w1`` gate and ``w3`` up ``[E, D, F]``, ``w2`` down ``[E, F, D]``; biases
``[E, F]`` / ``[E, D]`` where the family has them (gpt-oss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.ops.grouped_mm import grouped_mm


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, args: MoEArgs, num_experts: int | None = None):
        super().__init__()
        e, f = num_experts or args.num_experts, args.hidden_dim
        self.args = args
        self.w1 = nn.Parameter(torch.empty(e, dim, f))
        self.w3 = nn.Parameter(torch.empty(e, dim, f))
        self.w2 = nn.Parameter(torch.empty(e, f, dim))
        if args.expert_bias:
            self.b1, self.b3, self.b2 = (nn.Parameter(torch.empty(e, n)) for n in (f, f, dim))
        else:
            self.b1 = self.b3 = self.b2 = None
        self.kernel: bool | None = None  # None: the grouped kernel where available (ops/grouped_mm.py)

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [T', D] rows grouped by expert in expert order, ``counts`` [E_local] -> [T', D]."""
        a = self.args
        gate = grouped_mm(x, self.w1, counts, self.kernel)  # [T', F]
        up = grouped_mm(x, self.w3, counts, self.kernel)  # [T', F]
        if self.b1 is not None:
            rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                           output_size=x.shape[0])  # [T'] the expert of each row
            gate, up = gate + self.b1[rows], up + self.b3[rows]
        if a.activation == "clamped_swiglu":
            gate, up = gate.clamp(max=a.swiglu_limit), up.clamp(-a.swiglu_limit, a.swiglu_limit)
            h = (up + 1) * gate * torch.sigmoid(gate * a.swiglu_alpha)
        else:
            h = F.silu(gate) * up  # [T', F]
        out = grouped_mm(h, self.w2, counts, self.kernel)  # [T', D]
        return out + self.b2[rows] if self.b2 is not None else out
