"""Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (RMSNorm per q/k head, head_dim 128 by default)."""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import base_args, check_common, llama_tensors, qk_norm_bytes
from titan_ulysses.models.registry import HFConfigError, ModelFamily, register


def check_window(cfg: dict) -> None:
    # Qwen's window applies to layers from max_window_layers on; not implemented here
    if cfg.get("use_sliding_window"):
        raise HFConfigError(f"use_sliding_window true (sliding_window {cfg.get('sliding_window')}): sliding-window "
                            f"attention on Qwen layers is not supported; set use_sliding_window false")
    windowed = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        raise HFConfigError(f"layer_types contains {windowed[0]!r}: only full_attention layers are supported for "
                            f"model_type {cfg.get('model_type')!r}")


def qwen2_args(cfg: dict) -> DecoderArgs:
    check_common(cfg, biases=("mlp_bias",))
    check_window(cfg)
    return base_args(cfg, "qwen2", qkv_bias=True)


def qwen3_args(cfg: dict) -> DecoderArgs:
    check_common(cfg)
    check_window(cfg)
    return base_args(cfg, "qwen3", default_head_dim=128, qk_norm=True)


def qwen2_export(args: DecoderArgs, config: dict) -> dict:
    return {"use_sliding_window": False}


def qwen3_export(args: DecoderArgs, config: dict) -> dict:
    return {"use_sliding_window": False, "attention_bias": False}


def qwen3_layer_memory(decoder_terms, args: DecoderArgs, layout, switches, mode: str) -> float:
    """The decoder's per-layer memory terms and the per-head q/k norms' (``planning/layer_terms.py``)."""
    return decoder_terms(args, layout, switches, mode) + qk_norm_bytes(args, layout, switches, mode)


register(ModelFamily("qwen2", "Qwen2ForCausalLM", qwen2_args, llama_tensors, qwen2_export, "yarn"))
register(ModelFamily("qwen3", "Qwen3ForCausalLM", qwen3_args, llama_tensors, qwen3_export, "yarn",
                     layer_memory=qwen3_layer_memory))
