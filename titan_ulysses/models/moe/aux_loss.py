"""The router's load-balancing loss, as transformers computes it (Switch Transformer, eqs. 4-6).

Over all MoE layers pooled: ``E * sum_e f_e * P_e``, with ``f_e`` the share of top-k
assignments and ``P_e`` the mean probability of expert ``e`` over the counted tokens (rows
of every layer). Only ``P_e`` carries a gradient. Sharded over ranks (dp, cp, sp; ep moves
no router work), ``f_e`` and the row count are global sums, so each rank's share is
``E * sum_e f_e * prob_sum_e / rows_total``; the shares add up to the single-device loss,
the convention of ``step.py``.
"""

from __future__ import annotations

import torch

from titan_ulysses.models.moe.router import RouterStats


def load_balancing_loss(stats: RouterStats, total_counts: torch.Tensor | None = None,
                        total_rows: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's share of the loss; ``total_*``: ``stats``' counts and rows summed over every rank
    (None: one process, the whole loss)."""
    counts = stats.counts if total_counts is None else total_counts  # [E]
    rows = stats.rows if total_rows is None else total_rows  # []
    f = counts / rows  # [E] assignments per counted token (sums to top_k)
    return counts.numel() * (f * stats.prob_sum / rows).sum()
