"""What a resume may change, and what it may not without saying so.

Each checkpoint saves the config's values of ``SAVED_SETTINGS`` (``checkpoint/state.py``'s
``TrainState``), so that a resumed run compares its config with them (``resume_changes``):

* ``RESUME_SETTINGS`` (optimizer, schedule, steps, clipping): the config wins, and the change is named;
* ``MODEL_SETTINGS`` (what the model computes: model, RoPE, tokenizer, LoRA, attention, precision):
  a change is refused unless the setting is listed in ``checkpoint.override_recorded``, and then named;
* ``LAYOUT_SETTINGS`` (how the run computes: layout, activation checkpointing, compile, tiles): the
  config wins, and the change is named.

The same override list decides for the start checkpoint's record (``titan_ulysses/run_spec.py``).
"""

from __future__ import annotations

from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError

RESUME_SETTINGS = (
    "optimizer.lr", "optimizer.weight_decay", "optimizer.eps", "optimizer.beta1", "optimizer.beta2",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor", "training.steps", "training.max_norm",
)
MODEL_SETTINGS = (
    "model.flavor", "model.hf_assets_path", "model.rope_theta", "model.rope_scaling_factor",
    "model.rope_scaling_type", "model.rope_original_max_position_embeddings", "model.router_aux_loss_coef",
    "model.attn_backend",
    "lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules",
    "training.mixed_precision_param", "training.mixed_precision_reduce", "float8.enable", "float8.recipe",
)
LAYOUT_SETTINGS = (
    "parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
    "parallelism.context_parallel_degree", "parallelism.ulysses_degree", "parallelism.tensor_parallel_degree",
    "parallelism.expert_parallel_degree", "parallelism.ulysses_head_stages", "activation_checkpoint.mode",
    "activation_checkpoint.layers_per_checkpoint", "compile.enable", "model.sdpa_backends",
    "model.loss_backend", "model.loss_chunk_size", "model.mlp_tile_size",
)
SAVED_SETTINGS = RESUME_SETTINGS + MODEL_SETTINGS + LAYOUT_SETTINGS
# a checkpoint's adapters have its rank's shapes and its targets' names: no override can load them into others
FIXED_SETTINGS = ("lora.rank", "lora.target_modules")


def _value(config: JobConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def resume_settings(config: JobConfig) -> dict:
    """The config's values of ``SAVED_SETTINGS``, keyed ``section.key``."""
    return {key: _value(config, key) for key in SAVED_SETTINGS}


def overrides(config: JobConfig) -> tuple[str, ...]:
    """``checkpoint.override_recorded`` as setting names; a name that is not a setting a record holds, or one
    no override can change (``FIXED_SETTINGS``), is refused."""
    names = tuple(n.strip() for n in config.checkpoint.override_recorded.split(",") if n.strip())
    unknown = [n for n in names if n not in MODEL_SETTINGS]
    if unknown:
        allowed = ", ".join(k for k in MODEL_SETTINGS if k not in FIXED_SETTINGS)
        raise ConfigError(f"checkpoint.override_recorded names {', '.join(map(repr, unknown))}, which no record "
                          f"holds; it lists settings of: {allowed}")
    fixed = [n for n in names if n in FIXED_SETTINGS]
    if fixed:
        raise ConfigError(f"checkpoint.override_recorded names {fixed[0]}, which no override can change (a "
                          f"checkpoint's LoRA adapters have its lora.rank's shapes and its lora.target_modules' "
                          f"names): resume with its [lora] settings, or start a new run (another job.dump_folder) "
                          f"from its merged model (titan-export --checkpoint STEP --output DIR, then "
                          f"--model.hf_assets_path DIR)")
    return names


def resume_changes(saved: dict | None, current: dict, override: tuple[str, ...] = ()) -> str:
    """What the config changes from the checkpoint's settings, for the start-up line; a ConfigError
    (one line) when it changes what the model computes without ``checkpoint.override_recorded``."""
    if saved is None:
        return "the checkpoint records no settings; the config's apply"
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
    refused = [k for k in changed if k in MODEL_SETTINGS and k not in override]
    if refused:
        what = ", ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in refused)
        fixed = [k for k in refused if k in FIXED_SETTINGS]
        if fixed:  # no override can change them: overrides() refuses the advice below
            raise ConfigError(f"the resumed checkpoint was trained with other model settings ({what}); nothing was "
                              f"loaded: set them back; {fixed[0]} cannot change on resume (start a new run from its "
                              f"merged model: titan-export --checkpoint STEP --output DIR, then --model.hf_assets_path "
                              f"DIR)")
        raise ConfigError(f"the resumed checkpoint was trained with other model settings ({what}); nothing was "
                          f"loaded: set them back, resume on purpose with --checkpoint.override_recorded "
                          f"{','.join(refused)}, or train these settings from the start in another job.dump_folder "
                          f"(or checkpoint.folder)")

    def named(keys) -> str:
        return ", ".join(f"{k} {changed[k][0]} -> {changed[k][1]}" for k in keys)

    parts = []
    if [k for k in changed if k in MODEL_SETTINGS]:
        parts.append("overridden (checkpoint.override_recorded): " + named(k for k in changed if k in MODEL_SETTINGS))
    if [k for k in changed if k in RESUME_SETTINGS]:
        parts.append("the config changes " + named(k for k in changed if k in RESUME_SETTINGS))
    if [k for k in changed if k in LAYOUT_SETTINGS]:
        parts.append("the layout changes " + named(k for k in changed if k in LAYOUT_SETTINGS))
    return "; ".join(parts) if parts else "settings as in the checkpoint"
