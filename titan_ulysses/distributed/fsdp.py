"""FSDP2 over dp_shard x cp x sp (HSDP when dp_replicate > 1).

Sequence-parallel (sp and cp) ranks hold the same parameters but see different tokens, so
those dimensions are part of the FSDP mesh: parameters, gradients and optimizer state are
sharded over it and gradients are reduced over it -- also when there is no data
parallelism at all.

Gradients are *summed*, not averaged: each rank's loss is already divided by the token
count of the whole global batch (see ``step.py``), so the sum over ranks is
exactly the single-device gradient of the global mean loss, whatever the layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_ulysses.distributed.expert_parallel import ExpertParallel


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard each block, then the root (embeddings, final norm, output).

    ``dp_mesh`` is ``ParallelDims.get_mesh("fsdp")``: dp_shard x cp x sp flattened, or for HSDP
    the 2-D (dp_replicate, dp_shard x cp x sp) mesh. With expert parallelism, ``expert_mesh``
    (``ep_fsdp``) is where the experts (already sharded over ``ep``) are sharded further: the
    ranks outside ``ep``, whose copies of an expert saw other tokens, so their gradients add up.
    """
    kwargs = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if cpu_offload:
        # sharded parameters, gradients and optimizer state live in (pinned) host memory;
        # the optimizer steps on the CPU
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in model.layers.values():
        if expert_mesh is not None:  # their own group first: the block's leaves them out
            for experts in [m for m in block.modules() if isinstance(m, ExpertParallel)]:
                fully_shard(experts, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": expert_mesh})
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # the root is needed first in backward: keep its parameters gathered after forward
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has no PREMUL_SUM, and NCCL is zero-copy only for SUM
            module.set_force_sum_reduction_for_comms(True)
