"""Mistral (7B v0.3, Nemo with head_dim 128 != dim / heads, Ministral): Llama's block, a window or none.

``sliding_window`` (null on v0.3 and Nemo) applies to every layer: each query sees the
last ``sliding_window`` keys, itself included, passed as ``window=`` to the attention.
"""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors
from titan_ulysses.models.registry import ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    return base_args(cfg, "mistral", sliding_window=cfg.get("sliding_window", 4096) or 0)  # MistralConfig's default


def export_config(args: DecoderArgs, config: dict) -> dict:
    return {"sliding_window": args.sliding_window or None}


register(ModelFamily("mistral", "MistralForCausalLM", args_from_config, llama_tensors, export_config, "yarn"))
