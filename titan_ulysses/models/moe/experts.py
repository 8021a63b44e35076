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
from titan_ulysses.ops.routed_experts import RoutedExperts


class GroupedExperts(RoutedExperts):
    def __init__(self, dim: int, args: MoEArgs, num_experts: int | None = None):
        super().__init__()
        e, f = num_experts or args.num_experts, args.hidden_dim
        self.args, self.num_experts = args, e
        self.w1 = nn.Parameter(torch.empty(e, dim, f))
        self.w3 = nn.Parameter(torch.empty(e, dim, f))
        self.w2 = nn.Parameter(torch.empty(e, f, dim))
        if args.expert_bias:
            self.b1, self.b3, self.b2 = (nn.Parameter(torch.empty(e, n)) for n in (f, f, dim))
        else:
            self.b1 = self.b3 = self.b2 = None
        self.kernel: bool | None = None  # None: the grouped kernel where available (ops/grouped_mm.py)

    def expert_weights(self):
        return self.w1, self.w3, self.w2, self.b1, self.b3, self.b2

    def run(self, x: torch.Tensor, counts: torch.Tensor, *weights) -> torch.Tensor:
        """``x`` [T', D] rows grouped by expert in expert order, ``counts`` [E_local] -> [T', D]."""
        return run_experts(x, counts, self.args, *weights, kernel=self.kernel)


def run_experts(x, counts, args: MoEArgs, w1, w3, w2, b1=None, b3=None, b2=None, kernel=None) -> torch.Tensor:
    """The experts as a function of their weights (expert parallelism passes its local shards)."""
    gate = grouped_mm(x, w1, counts, kernel)  # [T', F]
    up = grouped_mm(x, w3, counts, kernel)  # [T', F]
    rows = None
    if b1 is not None:
        rows = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts,
                                       output_size=x.shape[0])  # [T'] the expert of each row
        gate, up = gate + b1[rows], up + b3[rows]
    if args.activation == "clamped_swiglu":
        gate, up = gate.clamp(max=args.swiglu_limit), up.clamp(-args.swiglu_limit, args.swiglu_limit)
        h = (up + 1) * gate * torch.sigmoid(gate * args.swiglu_alpha)
    else:
        h = F.silu(gate) * up  # [T', F]
    out = grouped_mm(h, w2, counts, kernel)  # [T', D]
    return out + b2[rows] if b2 is not None else out
