"""Lay the decoder out on the DeviceMesh: float8 -> TP -> CP -> Ulysses -> LoRA -> AC -> compile -> offload -> FSDP2.

Every family is laid out in this fixed order (``models/registry.parallelize_model``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_ulysses.distributed.activation_checkpoint import apply_ac
from titan_ulysses.distributed.activation_offload import apply_activation_offload
from titan_ulysses.distributed.compile import apply_compile
from titan_ulysses.distributed.context_parallel import apply_cp
from titan_ulysses.distributed.expert_parallel import apply_ep
from titan_ulysses.distributed.float8 import Float8Options, apply_float8
from titan_ulysses.distributed.fsdp import apply_fsdp
from titan_ulysses.distributed.lora import LoRAOptions, apply_lora
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.staged_attention import apply_head_stages, check_head_stages
from titan_ulysses.distributed.tensor_parallel import apply_tp
from titan_ulysses.distributed.ulysses import apply_ulysses, check_heads
from titan_ulysses.models.decoder.model import Transformer


@dataclass
class ParallelizeOptions:
    ac_mode: str = "none"
    """Activation checkpointing per block: "none", "full" or "selective"."""
    ac_layers_per_checkpoint: int = 1
    """Under full / full_offload AC, also checkpoint groups of this many blocks (``activation_checkpoint.layers_per_checkpoint``)."""
    compile: bool = False
    """torch.compile each transformer block with fullgraph=True."""
    param_dtype: torch.dtype = torch.bfloat16
    """Dtype FSDP gathers parameters in for compute (float32 for exact comparisons)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype of the gradient reduction."""
    cpu_offload: bool = False
    """FSDP2 CPU offload of sharded parameters, gradients and optimizer state."""
    float8: Float8Options | None = None
    """float8 linear layers through torchao (None: off)."""
    lora: LoRAOptions | None = None
    """LoRA adapters on a frozen base (None: full fine-tuning)."""
    ulysses_head_stages: int = 1
    """Attention in this many stages of head groups (``distributed/staged_attention.py``); 1 = off."""
    ulysses_stage_keep_attention: bool = True
    """Stages keep their attention kernel's outputs for backward (``parallelism.ulysses_stage_keep_attention``)."""


def parallelize_decoder(
    model: Transformer, parallel_dims: ParallelDims, options: ParallelizeOptions | None = None
) -> Transformer:
    """Apply every parallelism to ``model`` in place (typically still on the meta device).

    ``parallel_dims.build_mesh`` must have been called.
    """
    options = options or ParallelizeOptions()
    args = model.args
    check_heads(args.n_heads, args.n_kv_heads, parallel_dims.sp, parallel_dims.tp, parallel_dims.cp)
    check_head_stages(options.ulysses_head_stages, args.n_heads, args.n_kv_heads, parallel_dims.sp, parallel_dims.tp)
    if options.float8 is not None:
        apply_float8(model, options.float8)
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"))
    if parallel_dims.cp_enabled:  # inside Ulysses: heads are exchanged within sp, then K/V gathered over cp
        apply_cp(model, parallel_dims.get_mesh("cp"))
    if parallel_dims.sp_enabled:
        apply_ulysses(model, parallel_dims.get_mesh("sp"))
    apply_head_stages(model, options.ulysses_head_stages, options.ulysses_stage_keep_attention)  # after Ulysses (uses its group), before AC
    if parallel_dims.ep_enabled:  # experts sharded over ep, rows sent to them; before FSDP (which shards them further)
        apply_ep(model, parallel_dims.get_mesh("ep"))
    if options.lora is not None:  # frozen base in the compute dtype; AC, compile and FSDP see the adapters
        if parallel_dims.tp_enabled:
            raise ValueError("lora with tensor parallelism is not supported (config/manager.py says why)")
        apply_lora(model, options.lora, options.param_dtype)
    apply_ac(model, options.ac_mode, options.ac_layers_per_checkpoint)
    if options.compile:  # experts: a graph break where their row counts are read (distributed/compile.py)
        apply_compile(model, fullgraph=args.moe is None)
    if options.ac_mode == "full_offload":
        apply_activation_offload(model)  # outside the compiled region
    # FSDP2 is what casts parameters to param_dtype for compute, so a single rank with bf16
    # compute is wrapped too (over a mesh of one); otherwise it would silently train in fp32.
    # tp alone is wrapped too: FSDP makes every parameter a DTensor (the norms, the embedding and
    # the output layer, which TP leaves plain), so the optimizer's fused/foreach kernels get one
    # kind of tensor; without it fused AdamW refused "mixed torch.Tensor and DTensor" (issue 43).
    one_rank_wrap = options.param_dtype != torch.float32 or parallel_dims.tp_enabled
    if parallel_dims.fsdp_enabled or one_rank_wrap:
        apply_fsdp(model, parallel_dims.get_mesh("fsdp"), options.param_dtype, options.reduce_dtype,
                   cpu_offload=options.cpu_offload,
                   expert_mesh=parallel_dims.get_mesh("ep_fsdp") if parallel_dims.ep_enabled else None)
    return model
