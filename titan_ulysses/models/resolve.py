"""Config -> model arguments: the one place that reads ``model.flavor`` / ``model.hf_assets_path``
and applies the ``model.*`` overrides.

Used by the trainer, the pre-flight checks (``titan_ulysses/preflight.py``), the memory
estimate (``metrics/memory_fit.py``) and the scripts. ``config/`` does not import this
module (it imports nothing else of ours); this module imports ``config/``.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError
from titan_ulysses.models.hf_config import load_hf_args
from titan_ulysses.models.llama.args import LlamaArgs, RopeScaling, get_flavor


def model_args(config: JobConfig, vocab_size: int = 0) -> LlamaArgs:
    """The model's architecture (from model.flavor, or from the config.json of model.hf_assets_path)
    with the config's model overrides; ``vocab_size`` (the tokenizer's, 0: unknown) must fit in it.

    A setting that names no model, or a tokenizer larger than the model's vocabulary, is a
    ``ConfigError`` naming the setting.
    """
    m = config.model
    if m.hf_assets_path:
        try:
            args = load_hf_args(m.hf_assets_path, attn_backend=m.attn_backend)
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.hf_assets_path: {e}") from e
        source = "model.hf_assets_path"
    else:
        try:
            args = get_flavor(m.flavor, attn_backend=m.attn_backend)
        except ValueError as e:
            raise ConfigError(f"model.flavor: {e}") from e
        source = f"model.flavor {m.flavor!r}"
    if vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} ids but {source} has vocab_size {args.vocab_size}")
    overrides = {"loss_chunk_size": m.loss_chunk_size, "mlp_tile_size": m.mlp_tile_size,
                 "sdpa_backends": m.sdpa_backends}
    if m.rope_theta > 0:
        overrides["rope_theta"] = m.rope_theta
    if m.rope_scaling_factor > 0:
        overrides["rope_scaling"] = dataclasses.replace(args.rope_scaling or RopeScaling(), factor=m.rope_scaling_factor)
    return dataclasses.replace(args, **overrides)
