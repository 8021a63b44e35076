"""The run's model, laid out on the mesh: built on the meta device, parallelized in the fixed
order (``parallelize_model``), then materialised on this rank's device.

The weights are not set here: the checkpoint builder chooses where they come from, and
:func:`init_weights` is its random-init case.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.distributed.float8 import float8_options
from titan_ulysses.distributed.lora import lora_options
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import load_full_state_dict
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.models.registry import build_model, parallelize_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parallelize_options(config) -> ParallelizeOptions:
    """How the job's settings lay the model out: AC, compile, FSDP dtypes and offload, float8, LoRA, head stages."""
    t, p = config.training, config.parallelism
    return ParallelizeOptions(
        ac_mode=config.activation_checkpoint.mode,
        ac_layers_per_checkpoint=config.activation_checkpoint.layers_per_checkpoint,
        compile=config.compile.enable,
        param_dtype=DTYPES[t.mixed_precision_param],
        reduce_dtype=DTYPES[t.mixed_precision_reduce],
        cpu_offload=t.enable_cpu_offload,
        float8=float8_options(config),
        lora=lora_options(config.lora),
        ulysses_head_stages=p.ulysses_head_stages,
        ulysses_stage_keep_attention=p.ulysses_stage_keep_attention,
    )


def build_parallel_model(config, args: DecoderArgs, parallel_dims: ParallelDims, device: torch.device
                         ) -> tuple[nn.Module, ComputeOptions, ParallelizeOptions]:
    """(model, how it computes, how it is laid out) for ``args`` on the built mesh: parameters
    allocated on ``device`` but not initialised, RoPE buffers computed."""
    compute = ComputeOptions.from_config(config.model)  # how it computes (not in the checkpoint)
    options = parallelize_options(config)
    with torch.device("meta"):
        model = build_model(args, compute)
    model = parallelize_model(model, parallel_dims, options)
    model.rope_seq_len = config.training.seq_len  # the full length each rank's slice belongs to (longrope)
    model.to_empty(device=device)
    model.init_buffers(device)
    return model, compute, options


def init_weights(model: nn.Module, args: DecoderArgs, device: torch.device, seed: int, lora: bool = False) -> None:
    """Initialise the sharded model so that its weights do not depend on the layout.

    On CUDA, DTensor's offset-based RNG makes sharded init equal to unsharded init. On CPU
    there is no such tracker (every shard would draw the same numbers), so the full model
    is initialised on the host and loaded; CPU runs use small models.
    """
    if device.type == "cpu":
        model.init_buffers(device)
        full = build_model(args)
        torch.manual_seed(seed)
        full.init_weights()
        load_full_state_dict(model, full.state_dict(), strict=not lora)  # LoRA adapters: init_lora
    else:
        torch.manual_seed(seed)
        model.init_weights(buffer_device=device)
