"""The mixture-of-experts feed-forward of one block: route, sort rows by expert, experts, weighted sum.

Model code only: with expert parallelism, ``distributed/expert_parallel.py`` replaces
``self.experts`` by a module that sends the sorted rows to the ranks holding their experts
and back (the same ``(rows, counts) -> rows`` call).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.moe.experts import GroupedExperts
from titan_ulysses.models.moe.router import Router, RouterStats


class MoEFeedForward(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = Router(dim, args)
        self.experts = GroupedExperts(dim, args)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterStats]:
        """``x`` [B, S, D], ``valid`` [B, S] bool (tokens the load-balancing loss counts) -> ([B, S, D], stats)."""
        b, s, d = x.shape
        k = self.args.top_k
        flat = x.reshape(-1, d)  # [T, D]
        weights, experts, stats = self.router(flat, None if valid is None else valid.reshape(-1))  # [T, k] x2
        order = torch.argsort(experts.reshape(-1), stable=True)  # [T*k] (token, slot) pairs by expert
        counts = torch.zeros(self.args.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, experts.reshape(-1), torch.ones_like(order))  # [E]
        token = order // k  # [T*k] the token of each sorted row
        rows = self.experts(flat[token], counts)  # [T*k, D]
        # out of place: under FSDP the experts' output can be a view (FSDP2 warns so), and an in-place op on
        # it would drop FSDP's pre-backward hook (the weights' all-gather)
        rows = rows * weights.reshape(-1)[order, None]  # [T*k, D]
        out = torch.zeros_like(flat).index_add_(0, token, rows.to(flat.dtype))  # [T, D]
        return out.view(b, s, d), stats

    def init_weights(self, std: float = 0.02) -> None:
        for p in (self.router.weight, self.experts.w1, self.experts.w3, self.experts.w2):
            nn.init.trunc_normal_(p, std=std)
        for p in (self.router.bias, self.experts.b1, self.experts.b3, self.experts.b2):
            if p is not None:
                nn.init.zeros_(p)
