"""The range of every numeric setting, checked before any process group exists.

A value outside its range would fail much later (a ZeroDivisionError after a step, a NaN
learning rate that poisons the weights, clipping silently off), so ``check_ranges`` refuses
it at start-up with one line naming the setting. Every float must also be finite.
``tests/test_config.py`` checks that every int and float field of ``JobConfig`` has a row.
"""

from __future__ import annotations

import dataclasses
import math

# AdamW moves every weight by about lr per step: above 1 no model survives a step, and near
# float32's 3.4e38 the update itself overflows.
LR_MAX = 1.0
# A collective timeout beyond 30 days is a typo; far beyond it the timedelta overflows (1e20 s)
# or the backend's millisecond count wraps and fires at once (1e10 s).
TIMEOUT_MAX_S = 30 * 24 * 3600

# key: (low, high, low_inclusive, high_inclusive); None = unbounded on that side.
# The parallelism degrees are checked by ParallelDims (with the world size they need).
RANGES: dict[str, tuple] = {
    "model.rope_theta": (0, None, True, False),  # 0 keeps the flavor's
    "model.rope_scaling_factor": (0, None, True, False),
    "model.rope_original_max_position_embeddings": (0, None, True, False),
    "model.router_aux_loss_coef": (-1, 1, True, True),  # -1: config.json's; (-1, 0) refused in resolve; <= 1 as there
    "model.loss_chunk_size": (0, None, True, False),
    "model.mlp_tile_size": (0, None, True, False),
    "training.passkey_digits": (1, 9, True, True),
    "training.seq_len": (0, None, False, False),
    "training.local_batch_size": (0, None, False, False),
    "training.steps": (0, None, False, False),
    "training.seed": (0, 2**63 - 1, True, True),
    "training.max_norm": (0, None, True, False),  # 0 turns clipping off
    "training.skip_nonfinite_steps": (0, None, True, False),
    "training.gc_freq": (0, None, True, False),  # 0: Python's automatic collection, as without it
    "profiling.profile_freq": (1, None, True, False),
    "profiling.profiler_warmup": (0, None, True, False),
    "profiling.profiler_active": (1, None, True, False),
    "profiling.memory_snapshot_freq": (0, None, True, False),  # 0 = profile_freq
    "training.prefetch_batches": (0, 64, True, True),  # 0 = synchronous; each step ahead holds its batches
    "optimizer.lr": (0, LR_MAX, False, True),
    "optimizer.weight_decay": (0, None, True, False),
    "optimizer.eps": (0, None, False, False),
    "optimizer.beta1": (0, 1, True, False),
    "optimizer.beta2": (0, 1, True, False),
    "lr_scheduler.warmup_steps": (0, None, True, False),
    "lr_scheduler.decay_ratio": (0, 1, True, True),
    "lr_scheduler.min_lr_factor": (0, 1, True, True),
    "training.min_document_tokens": (0, None, True, False),  # 0 keeps every document
    "validation.freq": (0, None, False, False),
    "validation.steps": (0, None, False, False),
    "checkpoint.interval": (0, None, False, False),
    "checkpoint.keep_latest_k": (0, None, True, False),  # 0 keeps all
    "parallelism.ulysses_head_stages": (1, None, True, False),  # 1 = off; divides the heads: config/manager.py
    "activation_checkpoint.layers_per_checkpoint": (1, None, True, False),  # > 1 only under full AC: preflight.py
    "metrics.log_freq": (0, None, False, False),
    "comm.fake_world_size": (1, None, True, False),
    "comm.link_bandwidth_gbps": (0, None, False, False),
    "comm.init_timeout_seconds": (0, TIMEOUT_MAX_S, False, True),
    "comm.train_timeout_seconds": (0, TIMEOUT_MAX_S, False, True),
    "lora.rank": (0, None, True, False),  # 0 = off
    "lora.alpha": (0, None, False, False),
    "lora.dropout": (0, 1, True, False),
}
# Checked elsewhere, with the context they need.
EXEMPT = {
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.ulysses_degree", "parallelism.tensor_parallel_degree", "parallelism.context_parallel_degree",
    "parallelism.expert_parallel_degree",
    "training.global_batch_size",  # -1 or a positive multiple of local batch x dp (validate)
}


def describe(low, high, low_inc: bool, high_inc: bool) -> str:
    if high is None:
        if low == 0:
            return "positive" if not low_inc else ">= 0"
        return f"{'>=' if low_inc else '>'} {low}"
    return f"{'[' if low_inc else '('}{low}, {high}{']' if high_inc else ')'}"


def out_of_range(key: str, value, bounds: tuple | None = None) -> str | None:
    """The refusal for ``key = value``, or None when the value is in range.

    ``bounds`` is a ``RANGES`` row (default: ``RANGES[key]``); config.json's table
    (``interop/hf_ranges.py``) passes its own.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key} must be a finite number, got {value}"
    bounds = bounds or RANGES.get(key)
    if bounds is None:
        return None
    low, high, low_inc, high_inc = bounds
    ok = (value >= low if low_inc else value > low) if low is not None else True
    if high is not None:
        ok = ok and (value <= high if high_inc else value < high)
    if ok:
        return None
    what = describe(low, high, low_inc, high_inc)
    if high is None:
        return f"{key} must be {what}, got {value}"
    return f"{key} must lie in {what}, got {value}"


def numeric_fields(config) -> dict[str, object]:
    """``section.key -> value`` for every int and float setting of ``config``."""
    out = {}
    for section in dataclasses.fields(config):
        obj = getattr(config, section.name)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{section.name}.{f.name}"] = value
    return out


def check_ranges(config) -> str | None:
    """The first refusal among all numeric settings, or None."""
    for key, value in numeric_fields(config).items():
        message = out_of_range(key, value)
        if message:
            return message
    return None
