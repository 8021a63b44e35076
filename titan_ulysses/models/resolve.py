"""Config -> model arguments: the one place that reads ``model.flavor`` / ``model.hf_assets_path``
and applies the ``model.*`` overrides.

Used by the trainer, the pre-flight checks (``titan_ulysses/preflight.py``), the memory
estimate (``planning/inputs.py``) and the scripts. ``config/`` does not import this
module (it imports nothing else of ours); this module imports ``config/``.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.extension import extend_context
from titan_ulysses.models.flavors import TRAINED_SEQ_LEN, get_flavor
from titan_ulysses.interop.hf_config import load_hf_args, read_hf_config


def model_args(config: JobConfig, vocab_size: int = 0) -> DecoderArgs:
    """The model's architecture (from model.flavor, or from the config.json of model.hf_assets_path)
    with the config's model overrides; ``vocab_size`` (the tokenizer's, 0: unknown) must fit in it.

    A setting that names no model, or a tokenizer larger than the model's vocabulary, is a
    ``ConfigError`` naming the setting.
    """
    m = config.model
    if m.hf_assets_path:
        try:
            args = load_hf_args(m.hf_assets_path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_assets_path: {e}") from e
        source = "model.hf_assets_path"
    else:
        try:
            args = get_flavor(m.flavor)
        except ValueError as e:
            raise ConfigError(f"model.flavor: {e}") from e
        source = f"model.flavor {m.flavor!r}"
    if vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} ids but {source} has vocab_size {args.vocab_size}")
    if m.hf_assets_path:
        max_positions = read_hf_config(m.hf_assets_path).get("max_position_embeddings", 0)
    else:  # a flavor: the length it is trained at (a debug model's 512, not llama3's 8192)
        max_positions = TRAINED_SEQ_LEN.get(m.flavor, 0)
    return apply_model_settings(args, m, max_positions, source)


def apply_model_settings(args: DecoderArgs, m, max_positions: int = 0, source: str = "the model") -> DecoderArgs:
    """``args`` with the config's model settings (``m``: the config's model section) applied: ``rope_theta``
    when > 0, ``router_aux_loss_coef`` when not -1, context extension when ``rope_scaling_factor`` > 0;
    ``source`` names where ``args`` come from in a refusal."""
    if m.rope_theta > 0:
        args = dataclasses.replace(args, rope_theta=m.rope_theta)
    if m.router_aux_loss_coef != -1:
        if m.router_aux_loss_coef < 0:
            raise ConfigError(f"model.router_aux_loss_coef {m.router_aux_loss_coef:g}: -1 (config.json's), 0 (off) "
                              f"or a positive weight")
        if args.moe is None:
            raise ConfigError(f"model.router_aux_loss_coef {m.router_aux_loss_coef:g}: {source} has no experts; "
                              f"leave it at -1")
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, aux_loss_coef=m.router_aux_loss_coef))
    # how the run computes (attention backend, tiles, chunks) is not here: ComputeOptions.from_config
    try:
        return extend_context(args, m.rope_scaling_factor, m.rope_scaling_type, m.rope_original_max_position_embeddings,
                              max_positions)
    except ValueError as e:
        raise ConfigError(str(e)) from e
