"""Model arguments from a Hugging Face ``config.json``, by its ``model_type`` (``models/registry.py``).

Every shape comes from the file; anything the family's model would compute differently
(mixture of experts, state-space or linear-attention layers, unknown families, RoPE types
or settings, biases where the family has none, another activation) is refused with one
line naming the field and its value, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import os

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.interop.hf_ranges import check_hf_ranges, check_moe_fields, check_rope_lengths
from titan_ulysses.models.registry import HFConfigError, get_family

__all__ = ["HFConfigError", "args_from_hf_config", "describe", "load_hf_args", "read_hf_config"]
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
# mixtures of experts that compute what no family here does (issue 31): the reason, in one line
_MOE_REFUSED = {"deepseek_v3": "multi-head latent attention", "deepseek_v2": "multi-head latent attention",
                "qwen3_next": "linear-attention (Gated DeltaNet) layers", "jamba": "state-space (Mamba) layers",
                "qwen2_moe": "shared experts", "olmoe": "a different router"}
# keys only state-space / linear-attention hybrids have
_HYBRID_KEYS = ("mamba_d_state", "ssm_state_size", "state_size", "linear_num_key_heads", "attn_layer_indices",
                "mamba_n_heads", "hybrid_override_pattern")
_HYBRID_LAYERS = ("linear_attention", "mamba", "conv", "ssm")


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder!r} is not a folder (a Hugging Face model folder with config.json)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder!r} has no config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}: not valid JSON ({e})") from e


def _refuse_unsupported(cfg: dict) -> None:
    """Mixture of experts and state-space / linear-attention hybrids, whatever their model_type."""
    from titan_ulysses.models.registry import FAMILIES, get_family

    model_type = cfg.get("model_type")
    get_family("llama")  # registers every family
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if (moe or "moe" in str(model_type)) and model_type not in FAMILIES:
        detail = f" ({moe[0]} {cfg[moe[0]]})" if moe else ""
        why = _MOE_REFUSED.get(model_type, "not one of the mixture-of-experts families")
        moe_families = sorted(m for m, f in FAMILIES.items() if f.decoder.experts)
        raise HFConfigError(f"model_type {model_type!r} is a mixture-of-experts model{detail} with {why}: not "
                            f"supported (mixtures of experts here: {', '.join(moe_families)})")
    hybrid = [k for k in _HYBRID_KEYS if cfg.get(k) is not None]
    layers = [t for t in cfg.get("layer_types") or [] if any(h in str(t) for h in _HYBRID_LAYERS)]
    if hybrid or layers or any(h in str(model_type) for h in ("mamba", "jamba", "zamba", "rwkv")):
        what = f"layer_types contains {layers[0]!r}" if layers else (
            f"{hybrid[0]} {cfg[hybrid[0]]}" if hybrid else f"model_type {model_type!r}")
        raise HFConfigError(f"{what}: state-space / linear-attention layers are not supported (attention-only "
                            f"models are)")


def args_from_hf_config(cfg: dict, where: str = "config.json", **overrides) -> DecoderArgs:
    """Model arguments for a parsed config.json, by its family; raises HFConfigError naming the field it refuses
    (a number out of range also names ``where``, the file: ``interop/hf_ranges.py``)."""
    _refuse_unsupported(cfg)
    check_hf_ranges(cfg, where)
    family = get_family(cfg.get("model_type"))
    try:
        args = family.args_from_config(cfg)
    except KeyError as e:  # a field the family has no default for (num_experts_per_tok, moe_intermediate_size)
        raise HFConfigError(f"{where}: {e.args[0]} is missing; model_type {cfg.get('model_type')!r} needs it") from e
    check_rope_lengths(cfg, args.rotary_dim, where)
    check_moe_fields(getattr(args, "moe", None), cfg, where)
    try:
        return dataclasses.replace(args, **overrides)
    except (TypeError, ValueError) as e:
        raise HFConfigError(str(e)) from e


def load_hf_args(folder: str, **overrides) -> DecoderArgs:
    """The folder's config.json as ``DecoderArgs`` (FileNotFoundError / HFConfigError otherwise)."""
    return args_from_hf_config(read_hf_config(folder), os.path.join(folder, "config.json"), **overrides)


def describe(args: DecoderArgs) -> str:
    """One line for the start-up message: family and shapes read from config.json."""
    extras = [name for name, on in (("tied embeddings", args.tie_embeddings), ("qkv bias", args.qkv_bias),
                                    ("qk norm", args.qk_norm)) if on]
    s = args.rope_scaling
    rope = f"rope theta {args.rope_theta:g}" + (f" {s.rope_type} x{s.factor:g}" if s else "")
    if args.sliding_window:
        extras.append(f"sliding window {args.sliding_window}")
    if args.rotary_fraction != 1:
        extras.append(f"rotary {args.rotary_fraction:g} of each head")
    moe = getattr(args, "moe", None)
    if moe is not None:
        aux = f"load-balancing loss x{moe.aux_loss_coef:g}" if moe.aux_loss_coef else "no load-balancing loss"
        extras.append(f"{moe.num_experts} experts of {moe.hidden_dim} (top-{moe.top_k}, {aux})")
    return (f"{get_family(args.family).architecture} {args.n_layers} layers, dim {args.dim}, {args.n_heads} heads "
            f"({args.n_kv_heads} kv, head_dim {args.head_dim}), ffn {args.ffn_hidden_dim}, vocab {args.vocab_size}, "
            f"{rope}" + "".join(f", {e}" for e in extras))
