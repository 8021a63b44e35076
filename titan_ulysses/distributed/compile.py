"""torch.compile per transformer block (the blocks are identical, so one compiled graph serves all).

Whole blocks (``fullgraph``) wherever the block has no host sync. A mixture of experts' block has
one: the grouped product and the dispatch read how many rows each expert gets (``.tolist()``), so
its blocks compile with a graph break there (attention, norms and router compiled around it)."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=fullgraph))
