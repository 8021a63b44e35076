"""Gemma 3 text (``gemma3_text``) and Gemma 2 (``gemma2``): their own block (models/gemma/model.py).

Per ``layer_types`` (or the older ``sliding_window_pattern``, default 6: every sixth layer
global; Gemma 2: every other one) a layer is "sliding_attention" (window ``sliding_window``, RoPE base
``rope_local_base_freq`` / ``rope_parameters.sliding_attention``) or "full_attention"
(RoPE ``rope_theta`` with its scaling / ``rope_parameters.full_attention``). Gemma 2 has one
RoPE, no q/k norms, every other layer sliding, and soft-caps attention scores and final
logits; it runs on the attention backends that softcap (``registry.check_compute``).
"""

from __future__ import annotations

from titan_ulysses.models.families.common import (
    base_args, check_common, llama_tensors, parallelize_llama, parse_rope, refuse,
)
from titan_ulysses.models.gemma.args import GemmaArgs
from titan_ulysses.models.llama.args import LlamaArgs
from titan_ulysses.models.registry import HFConfigError, HFTensors, ModelFamily, register

ACT = "gelu_pytorch_tanh"


def _rope_of(cfg: dict, layer_type: str, theta_key: str, default_theta: float):
    """(theta, scaling) of one layer type, from rope_parameters[layer_type] or the older flat keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        sub = dict(params[layer_type] or {})
        sub.setdefault("rope_theta", default_theta)
        one = {"rope_parameters": sub, "max_position_embeddings": cfg.get("max_position_embeddings")}
    else:
        one = {"rope_theta": cfg.get(theta_key, default_theta),
               "rope_scaling": cfg.get("rope_scaling") if layer_type == "full_attention" else None,
               "max_position_embeddings": cfg.get("max_position_embeddings")}
    try:
        return parse_rope(one)
    except HFConfigError as e:
        raise HFConfigError(f"{layer_type}: {e}") from e


def args_from_config(cfg: dict) -> LlamaArgs:
    if cfg.get("model_type") == "gemma3_text":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                refuse(cfg, key, "null: Gemma 3 has no softcapping")
    if cfg.get("use_bidirectional_attention"):
        refuse(cfg, "use_bidirectional_attention", "false: causal language models only")
    if cfg.get("hidden_activation", ACT) != ACT:
        refuse(cfg, "hidden_activation", ACT)
    check_common({k: v for k, v in cfg.items() if k not in ("hidden_act", "rope_parameters")}, act=ACT)
    gemma2 = cfg.get("model_type") == "gemma2"
    n = int(cfg.get("num_hidden_layers", 0))
    # Gemma 2 alternates whatever the file says (transformers ignores its sliding_window_pattern)
    pattern = 2 if gemma2 else int(cfg.get("sliding_window_pattern", 6))
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if gemma2:  # one RoPE for every layer
        theta, scaling = parse_rope(cfg)
        local_theta, local_scaling = theta, scaling
    else:
        theta, scaling = _rope_of(cfg, "full_attention", "rope_theta", 1_000_000.0)
        local_theta, local_scaling = _rope_of(cfg, "sliding_attention", "rope_local_base_freq", 10_000.0)
    flat = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
    cfg = {**flat, "head_dim": cfg.get("head_dim", 256), "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
           "tie_word_embeddings": cfg.get("tie_word_embeddings", True), "pad_token_id": cfg.get("pad_token_id", 0)}
    args = base_args(cfg, cfg["model_type"], sliding_window=cfg.get("sliding_window", 4096) or 0, qk_norm=not gemma2)
    softcaps = {"attn_softcap": float(cfg.get("attn_logit_softcapping", 50.0 if gemma2 else 0) or 0),
                "final_softcap": float(cfg.get("final_logit_softcapping", 30.0 if gemma2 else 0) or 0)}
    try:
        return GemmaArgs(**{**vars(args), "rope_theta": theta, "rope_scaling": scaling, "layer_types": list(layer_types),
                            "local_rope_theta": local_theta, "local_rope_scaling": local_scaling,
                            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)), **softcaps})
    except (TypeError, ValueError) as e:
        raise HFConfigError(str(e)) from e


def hf_tensors(args: LlamaArgs) -> HFTensors:
    table = llama_tensors(args)
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        # Gemma's post-attention norm is a true post-norm; its pre-MLP norm has a name of its own
        table[theirs + "post_attention_layernorm.weight"] = [(ours + "post_attention_norm.weight", 0)]
        table[theirs + "pre_feedforward_layernorm.weight"] = [(ours + "ffn_norm.weight", 0)]
        table[theirs + "post_feedforward_layernorm.weight"] = [(ours + "post_ffn_norm.weight", 0)]
    return table


def _number(x: float):
    return int(x) if float(x).is_integer() else x  # Gemma3TextConfig types it int


def export_config(args: GemmaArgs, config: dict) -> dict:
    from titan_ulysses.models.families.common import rope_config

    local = rope_config(GemmaArgs(**{**vars(args), "rope_scaling": args.local_rope_scaling}))
    full = rope_config(args)
    return {
        "_remove": ("hidden_act", "rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"),
        "hidden_activation": ACT, "query_pre_attn_scalar": _number(args.query_pre_attn_scalar),
        "sliding_window": args.sliding_window or None, "layer_types": list(args.layer_types),
        "attention_bias": False, "final_logit_softcapping": args.final_softcap or None,
        "attn_logit_softcapping": args.attn_softcap or None,
        "rope_parameters": {"full_attention": {**(full or {"rope_type": "default"}), "rope_theta": args.rope_theta},
                            "sliding_attention": {**(local or {"rope_type": "default"}),
                                                  "rope_theta": args.local_rope_theta}}
        if args.family == "gemma3_text" else {**(full or {"rope_type": "default"}), "rope_theta": args.rope_theta},
    }


def build(args: GemmaArgs, compute=None):
    from titan_ulysses.models.gemma.model import GemmaTransformer

    return GemmaTransformer(args, compute)


register(ModelFamily("gemma3_text", "Gemma3ForCausalLM", args_from_config, hf_tensors, export_config, build,
                     parallelize_llama, "linear", GemmaArgs))
register(ModelFamily("gemma2", "Gemma2ForCausalLM", args_from_config, hf_tensors, export_config, build,
                     parallelize_llama, "", GemmaArgs))
