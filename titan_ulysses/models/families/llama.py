"""Llama 3.x (``model_type`` llama): the Transformer as it is; also every named ``model.flavor``."""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors
from titan_ulysses.models.registry import ModelFamily, register


def args_from_config(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    return base_args(cfg, "llama")


def export_config(args: DecoderArgs, config: dict) -> dict:
    return {"attention_bias": False, "mlp_bias": False}


register(ModelFamily("llama", "LlamaForCausalLM", args_from_config, llama_tensors, export_config, "llama3"))
