"""Tensor parallelism (Megatron-style) with ``parallelize_module``.

Attention heads and MLP columns are split over the ``tp`` mesh: q/k/v and w1/w3 are
column-parallel, wo and w2 row-parallel. Each tp rank therefore holds ``H/tp`` heads,
and Ulysses exchanges those local heads over ``sp``. Embeddings, norms and the output
layer stay replicated over tp (FSDP still shards them over dp_shard x sp).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)
