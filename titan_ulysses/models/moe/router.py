"""The router: which experts each token goes to, with what weight, and what the load-balancing loss needs."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from titan_ulysses.models.moe.args import MoEArgs


class RouterStats(NamedTuple):
    """One layer's (or the sum over layers of) routing statistics over the valid tokens of this rank."""

    counts: torch.Tensor
    """[E] top-k assignments per expert (no gradient)."""
    prob_sum: torch.Tensor
    """[E] fp32, the softmax probability of each expert summed over tokens (carries the router's gradient)."""
    rows: torch.Tensor
    """[] fp32, tokens counted (summed over layers, as transformers pools them)."""

    def __add__(self, other: "RouterStats") -> "RouterStats":  # type: ignore[override]
        return RouterStats(self.counts + other.counts, self.prob_sum + other.prob_sum, self.rows + other.rows)


class Router(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, dim))
        self.bias = nn.Parameter(torch.empty(args.num_experts)) if args.router_bias else None

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None):
        """``x`` [T, D], ``valid`` [T] bool or None -> (weights [T, k] in x's dtype, experts [T, k], RouterStats)."""
        a = self.args
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)  # [T, E] fp32: the load-balancing loss's, either way
        if a.router == "topk_softmax":
            top, experts = torch.topk(logits, a.top_k, dim=-1)  # [T, k]
            weights = torch.softmax(top, dim=-1)
        else:
            top, experts = torch.topk(probs, a.top_k, dim=-1)  # [T, k]
            if a.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            weights = top.to(x.dtype)
        keep = torch.ones(x.shape[0], device=x.device) if valid is None else valid.float()  # [T]
        with torch.no_grad():
            counts = torch.zeros(a.num_experts, device=x.device).scatter_add_(
                0, experts.reshape(-1), keep.repeat_interleave(a.top_k))  # [E]
        stats = RouterStats(counts, (probs * keep[:, None]).sum(0), keep.sum())
        return weights, experts, stats
