"""torch.compile per transformer block (the blocks are identical, so one compiled graph serves all)."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, fullgraph=True))
