"""Model arguments from a Hugging Face ``config.json`` (Llama 3.x, Qwen3, Qwen2 / Qwen2.5).

Every shape comes from the file; anything this Transformer would compute differently
(sliding-window attention, mixture of experts, other RoPE types, biases where the family
has none, another activation) is refused with one line naming the field and its value,
before any weight is read. Both spellings of RoPE settings are read: ``rope_theta`` +
``rope_scaling`` (the files on the Hub) and ``rope_parameters`` (transformers >= 5).
"""

from __future__ import annotations

import json
import os

from titan_ulysses.models.llama.args import LlamaArgs, RopeScaling

FAMILIES = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


class HFConfigError(ValueError):
    """config.json describes a model this trainer cannot train exactly; the message names the field."""


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


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = params if isinstance(params, dict) else cfg.get("rope_scaling")
    theta = (params or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    field = "rope_parameters.rope_type" if params else "rope_scaling.rope_type"
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise HFConfigError(f"{field} {kind!r} is not supported (default or llama3)")
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _refuse_unsupported(cfg: dict, family: str) -> None:
    model_type = cfg.get("model_type")
    moe = [k for k in _MOE_KEYS if cfg.get(k)]
    if moe or "moe" in str(model_type):
        detail = f" ({moe[0]} {cfg[moe[0]]})" if moe else ""
        raise HFConfigError(f"model_type {model_type!r} is a mixture-of-experts model{detail}: not supported")
    if family not in FAMILIES:
        raise HFConfigError(f"model_type {model_type!r} is not supported (one of {list(FAMILIES)})")
    if cfg.get("use_sliding_window"):
        raise HFConfigError(
            f"use_sliding_window true (sliding_window {cfg.get('sliding_window')}): sliding-window attention "
            f"is not supported"
        )
    layer_types = [t for t in cfg.get("layer_types") or [] if t != "full_attention"]
    if layer_types:
        raise HFConfigError(f"layer_types contains {layer_types[0]!r}: only full_attention layers are supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act {act!r} is not supported (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key) and family in ("llama", "qwen3"):
            raise HFConfigError(f"{key} true is not supported for model_type {model_type!r}")


def args_from_hf_config(cfg: dict, **overrides) -> LlamaArgs:
    """``LlamaArgs`` for a parsed config.json; raises HFConfigError naming the field it refuses."""
    family = cfg.get("model_type")
    _refuse_unsupported(cfg, family)
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or (128 if family == "qwen3" else dim // n_heads)
        theta, scaling = _rope(cfg)
        args = LlamaArgs(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), vocab_size=int(cfg["vocab_size"]),
            ffn_hidden_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim_override=0 if head_dim * n_heads == dim else int(head_dim),
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3", family=family, **overrides,
        )
    except KeyError as e:
        raise HFConfigError(f"no {e.args[0]} in config.json") from e
    except (TypeError, ValueError) as e:
        raise HFConfigError(str(e)) from e
    return args


def load_hf_args(folder: str, **overrides) -> LlamaArgs:
    """The folder's config.json as ``LlamaArgs`` (FileNotFoundError / HFConfigError otherwise)."""
    return args_from_hf_config(read_hf_config(folder), **overrides)


def describe(args: LlamaArgs) -> str:
    """One line for the start-up message: family and shapes read from config.json."""
    extras = [name for name, on in (("tied embeddings", args.tie_embeddings), ("qkv bias", args.qkv_bias),
                                    ("qk norm", args.qk_norm)) if on]
    rope = f"rope theta {args.rope_theta:g}" + (
        f" llama3 x{args.rope_scaling.factor:g}" if args.rope_scaling else "")
    return (f"{ARCHITECTURES[args.family]} {args.n_layers} layers, dim {args.dim}, {args.n_heads} heads "
            f"({args.n_kv_heads} kv, head_dim {args.head_dim}), ffn {args.ffn_hidden_dim}, vocab {args.vocab_size}, "
            f"{rope}" + "".join(f", {e}" for e in extras))
