"""Pre-flight: every check a launch makes before any process group, in one place above the packages.

``config/`` only parses and range-checks (``config/manager.py``'s ``check_config`` and
``check_requirements``, importing nothing else of ours). What needs the model, the
parallelism layout, this machine or the files the settings name is here:

* ``validate(config, world_size)``: the layout (``ParallelDims``), the heads and sequence
  length for it, the attention and float8 settings; reads the model's config.json when
  ``model.hf_assets_path`` is set (through ``models/resolve.py``);
* ``check_files(config)``: the tokenizer file, the Hugging Face weights' safetensors
  headers, the DCP metadata of ``checkpoint.initial_load_path``.

The trainer runs both before it joins the process group; ``train.py --dry-run`` runs them
and the rest of the plan (``titan_ulysses/dry_run.py``).
"""

from __future__ import annotations

import os

from titan_ulysses.checkpoint.hf import check_hf_weights
from titan_ulysses.checkpoint.hf_export import check_dcp_model_shapes
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, check_config, check_requirements, resolved_global_batch_size
from titan_ulysses.data.hf_tokenizer import hf_tokenizer_file
from titan_ulysses.data.sharding import check_seq_len
from titan_ulysses.distributed.float8 import check_float8, float8_options
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import check_heads
from titan_ulysses.models.resolve import model_args
from titan_ulysses.ops.attention import parse_sdpa_backends

# sdpa masks packed documents with a dense [B, 1, S, S] boolean mask; above this many
# elements (1 GiB, with about twice that in temporaries) it is refused in favour of flex.
SDPA_DENSE_MASK_MAX_ELEMENTS = 2**30


def validate(config: JobConfig, world_size: int) -> ParallelDims:
    """Every setting's range and the cross-field checks that need only the world size (and the
    model's config.json); returns the ParallelDims to build.

    In ``comm.mode = "fake"`` the job must be one process and the layout is checked
    against ``comm.fake_world_size``.
    """
    p, t = config.parallelism, config.training
    world_size = check_config(config, world_size)
    try:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, sp=p.ulysses_degree, tp=p.tensor_parallel_degree, world_size=world_size,
        )
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from e
    args = model_args(config)
    source = f"model.hf_assets_path {config.model.hf_assets_path!r}" if config.model.hf_assets_path else (
        f"model.flavor {config.model.flavor!r}")
    try:
        check_heads(args.n_heads, args.n_kv_heads, dims.sp, dims.tp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"parallelism.ulysses_degree / tensor_parallel_degree: {e} ({source})") from e
    try:
        check_seq_len(t.seq_len, dims.sp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"training.seq_len: {e}") from e
    try:
        parse_sdpa_backends(config.model.sdpa_backends)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if dims.cp > 1 and config.model.attn_backend != "sdpa":
        raise ConfigError(
            f"parallelism.context_parallel_degree {dims.cp} is implemented for model.attn_backend 'sdpa' only, "
            f"not {config.model.attn_backend!r}; use 'sdpa' (or context_parallel_degree 1)"
        )
    dp = dims.size("dp")
    gbs = resolved_global_batch_size(config, dp)
    if gbs <= 0 or gbs % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size {gbs} must be a positive multiple of training.local_batch_size x dp = "
            f"{t.local_batch_size} x {dp} = {t.local_batch_size * dp}"
        )
    check_requirements(config)
    _check_dense_mask(config, dims)
    if config.float8.enable:
        try:
            check_float8(float8_options(config), dims.tp)
        except (ValueError, ImportError) as e:
            raise ConfigError(str(e)) from e
    return dims


def _check_dense_mask(config: JobConfig, dims: ParallelDims) -> None:
    """Packed documents on sdpa need a dense [B, 1, S, S] mask: refused where it would not fit."""
    t, v = config.training, config.validation
    kinds = {t.dataset} | ({v.dataset or t.dataset} if v.enable else set())
    packed = t.packing and bool(kinds - {"passkey"})
    if packed and config.model.attn_backend == "sdpa":
        from titan_ulysses.data.sharding import padded_length

        s = padded_length(t.seq_len, dims.sp)
        if t.local_batch_size * s * s > SDPA_DENSE_MASK_MAX_ELEMENTS:
            gib = t.local_batch_size * s * s / 2**30
            raise ConfigError(
                f"packed documents on model.attn_backend 'sdpa' need a dense [{t.local_batch_size}, 1, {s}, {s}] "
                f"document mask ({gib:.0f} GiB) at training.seq_len {t.seq_len}; use model.attn_backend 'flex' "
                f"or 'flash_attn', or training.packing = false (one document per window)"
            )


def check_files(config: JobConfig) -> None:
    """Every file a setting names exists and fits the model: one line naming the setting, before any weight is read.

    Separate from ``validate`` (which tools such as estimate_memory run on machines without
    the data); the trainer runs both before any process group starts.
    """
    m, c = config.model, config.checkpoint
    args = model_args(config)
    if m.tokenizer == "tiktoken" and not os.path.isfile(m.tokenizer_path):
        raise ConfigError(f"model.tokenizer_path {m.tokenizer_path!r} is not a file (a Llama-3 tokenizer.model)")
    if m.tokenizer == "hf":
        try:
            hf_tokenizer_file(m.tokenizer_path or m.hf_assets_path)
        except FileNotFoundError as e:
            raise ConfigError(f"model.{'tokenizer_path' if m.tokenizer_path else 'hf_assets_path'}: {e}") from e
    if c.initial_load_in_hf:
        try:
            check_hf_weights(m.hf_assets_path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_in_hf: model.hf_assets_path {m.hf_assets_path!r}: {e}") from e
    if c.initial_load_path:
        try:
            check_dcp_model_shapes(c.initial_load_path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from e
