"""What the model and the layout cannot do together: one row per component, run in one order.

Each component owns its check (a function beside the code it protects, raising ``ValueError``
with one line); ``CHECKS`` registers it with how its line is framed, and pre-flight
(``preflight.validate``) runs the rows in this order, before any process group. A new check is
its function plus one row here. The ranges of single settings and what one setting requires of
another are ``config/``'s (``check_config``, ``check_requirements``); the files a setting names
are ``preflight.check_files``'; what a device cannot do is ``preflight.check_device``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from titan_ulysses.config.job_config import JobConfig, parse_lora_targets
from titan_ulysses.config.manager import ConfigError, resolved_global_batch_size
from titan_ulysses.data.sharding import check_seq_len
from titan_ulysses.distributed.activation_checkpoint import check_layers_per_checkpoint
from titan_ulysses.distributed.float8 import check_float8, float8_options
from titan_ulysses.distributed.heads import check_heads
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.staged_attention import check_head_stages
from titan_ulysses.metrics.profiling import check_memory_snapshot
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.moe.checks import check_moe
from titan_ulysses.models.registry import check_compute
from titan_ulysses.ops.attention import check_attention_settings
from titan_ulysses.ops.loss import check_loss_backend


@dataclass(frozen=True)
class Run:
    """What a check sees: the settings, the layout, the model and where the model came from."""

    config: JobConfig
    dims: ParallelDims
    args: DecoderArgs
    source: str
    """``model.hf_assets_path '...'`` or ``model.flavor '...'``, for lines that name the model."""


def _staged_with(run: Run) -> None:
    """Head stages slice plain projections per head group: no sinks, adapters or float8 linears."""
    stages, c = run.config.parallelism.ulysses_head_stages, run.config
    if stages > 1 and run.args.attn_sinks:
        raise ValueError(f"parallelism.ulysses_head_stages {stages} with attention sinks ({run.source}): not "
                         f"implemented; set parallelism.ulysses_head_stages 1")
    if stages > 1 and (c.lora.rank > 0 or c.float8.enable):
        other = "lora.rank > 0" if c.lora.rank > 0 else "float8.enable"
        raise ValueError(f"parallelism.ulysses_head_stages {stages} with {other}: the staged attention slices plain "
                         f"nn.Linear projections per head group only; set parallelism.ulysses_head_stages 1")


def _selective_with_ep(run: Run) -> None:
    """The experts' own FSDP unit sits inside the block: under selective AC its all-gather hooks run a
    different number of ops in the recompute than in the forward, which selective AC cannot replay."""
    mode = run.config.activation_checkpoint.mode
    if mode == "selective" and run.dims.ep > 1:
        raise ValueError(f"activation_checkpoint.mode selective with parallelism.expert_parallel_degree "
                         f"{run.dims.ep}: not supported (the experts' FSDP unit inside a selectively checkpointed "
                         f"block); use mode full or full_offload, or expert_parallel_degree 1")


def _batch(run: Run) -> None:
    t, dp = run.config.training, run.dims.size("dp")
    gbs = resolved_global_batch_size(run.config, dp)
    if gbs <= 0 or gbs % (t.local_batch_size * dp):
        raise ValueError(f"training.global_batch_size {gbs} must be a positive multiple of training.local_batch_size "
                         f"x dp = {t.local_batch_size} x {dp} = {t.local_batch_size * dp}")


def _float8(run: Run) -> None:
    if run.config.float8.enable:
        try:
            check_float8(float8_options(run.config), run.dims.tp)
        except ImportError as e:
            raise ValueError(str(e)) from e


CHECKS: tuple[tuple[str, Callable[[Run], None], str], ...] = (
    # (component, check, how its line is framed: {e} the check's line, {source} the model's origin)
    ("models/registry.py: the backend computes what the family needs",
     lambda r: check_compute(r.args, r.config.model.attn_backend, r.config.model.sdpa_backends), "{e}"),
    ("distributed/heads.py: heads over sp x tp (x cp)",
     lambda r: check_heads(r.args.n_heads, r.args.n_kv_heads, r.dims.sp, r.dims.tp, r.dims.cp),
     "parallelism.ulysses_degree / tensor_parallel_degree: {e} ({source})"),
    ("distributed/staged_attention.py: head stages",
     lambda r: check_head_stages(r.config.parallelism.ulysses_head_stages, r.args.n_heads, r.args.n_kv_heads,
                                 r.dims.sp, r.dims.tp), "{e} ({source})"),
    ("models/moe/checks.py: experts over ep, no tp, no LoRA on experts",
     lambda r: check_moe(r.args, r.dims.ep, r.dims.tp, parse_lora_targets(r.config.lora.target_modules)
                         if r.config.lora.rank > 0 else None, r.source), "{e}"),
    ("distributed/staged_attention.py: what head stages cannot slice", _staged_with, "{e}"),
    ("distributed/activation_checkpoint.py: selective AC around the experts' FSDP unit", _selective_with_ep, "{e}"),
    ("distributed/activation_checkpoint.py: groups of layers",
     lambda r: check_layers_per_checkpoint(r.config.activation_checkpoint.mode,
                                           r.config.activation_checkpoint.layers_per_checkpoint), "{e}"),
    ("data/sharding.py: the sequence over sp x cp",
     lambda r: check_seq_len(r.config.training.seq_len, r.dims.sp, r.dims.cp), "training.seq_len: {e}"),
    ("ops/attention/registry.py: what the backend cannot do (the device: check_device)",
     lambda r: check_attention_settings(r.config.model.attn_backend, r.config.model.sdpa_backends, r.dims.cp), "{e}"),
    ("ops/loss/registry.py: the loss backend on this machine (CUDA, its package, the final softcap)",
     lambda r: check_loss_backend(r.config.model.loss_backend, r.args.final_softcap), "{e}"),
    ("the global batch over dp", _batch, "{e}"),
    ("distributed/float8.py: this machine and layout", _float8, "{e}"),
    ("metrics/profiling.py: memory snapshots need CUDA",
     lambda r: check_memory_snapshot(r.config.profiling.enable_memory_snapshot), "{e}"),
)


def run_checks(run: Run) -> None:
    """Every row of ``CHECKS`` in order; the first refusal is a ``ConfigError`` of one line."""
    for _, check, line in CHECKS:
        try:
            check(run)
        except ValueError as e:
            raise ConfigError(line.format(e=e, source=run.source)) from e
