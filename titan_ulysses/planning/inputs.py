"""What the planner takes: one rank's layout and the memory switches, read from a config.

``estimate.py`` counts from these, ``track.py`` runs the step they describe, ``recommend.py`` searches over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_ulysses.config.manager import resolved_global_batch_size
from titan_ulysses.models.resolve import model_args

GIB = 1024**3


@dataclass
class Layout:
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel degree, borrowed from ``dp_shard x cp x sp`` (``distributed/parallel_dims.py``): a mixture
    of experts' expert weights are split over ``ep`` ranks, then FSDP-sharded over the ``n / ep`` others."""


@dataclass
class Switches:
    ac_mode: str = "none"
    ac_layers_per_checkpoint: int = 1
    """``activation_checkpoint.layers_per_checkpoint``: full AC in groups of this many blocks (``groups.py``)."""
    loss_chunk_size: int = 0
    """``model.loss_chunk_size``: rows per chunk of the fused / chunked loss (0: ``ops/loss``'s automatic choice)."""
    loss_backend: str = "fused"
    """``model.loss_backend`` (``ops/loss/registry.py``): what the loss keeps depends on it."""
    mlp_tile_size: int = 0
    cpu_offload: bool = False
    act_bytes: int = 2
    """Bytes per activation: 2 (bf16 compute) or 4 (fp32)."""
    microbatches: int = 1
    """Microbatches per optimizer step (gradient accumulation): from the second on, the sharded
    gradients of the earlier ones exist through the whole forward and backward."""
    lora_rank: int = 0
    """LoRA adapters of this rank on every projection of every block (0: full fine-tuning). The
    frozen base is stored sharded in the compute dtype and has no gradient or optimizer state;
    only the adapters (fp32) have both (``distributed/lora.py``)."""
    head_stages: int = 1
    """``parallelism.ulysses_head_stages``: attention in this many stages of head groups."""
    stage_keep_attention: bool = True
    """``parallelism.ulysses_stage_keep_attention``: stages keep their attention kernel's outputs for backward."""


def from_config(config, dims, args=None):
    """(args, Layout, Switches) of ``config`` on ``dims``; ``args``: the run spec's model (default: the config's)."""
    args = args if args is not None else model_args(config, 0)
    t = config.training
    dp = dims.size("dp")
    switches = Switches(
        ac_mode=config.activation_checkpoint.mode, loss_chunk_size=config.model.loss_chunk_size,
        loss_backend=config.model.loss_backend,
        ac_layers_per_checkpoint=config.activation_checkpoint.layers_per_checkpoint,
        mlp_tile_size=config.model.mlp_tile_size, cpu_offload=t.enable_cpu_offload,
        act_bytes=2 if t.mixed_precision_param == "bfloat16" else 4,
        microbatches=resolved_global_batch_size(config, dp) // (t.local_batch_size * dp),
        lora_rank=config.lora.rank,
        head_stages=config.parallelism.ulysses_head_stages,
        stage_keep_attention=config.parallelism.ulysses_stage_keep_attention,
    )
    return args, Layout(dp_shard=dims.size("dp_shard"), sp=dims.sp, tp=dims.tp, cp=dims.cp, ep=dims.ep), switches
