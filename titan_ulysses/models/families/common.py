"""What the Llama-shaped families share: config.json fields, RoPE settings, the tensor table, export keys.

Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (the files on
the Hub) and ``rope_parameters`` (transformers >= 5). Anything this Transformer would
compute differently is refused with one line naming the field and its value.
"""

from __future__ import annotations

from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling
from titan_ulysses.models.registry import HFConfigError, HFTensors
from titan_ulysses.models.rope import REFUSED, ROPE_TYPES


def _rope_dict(cfg: dict) -> tuple[dict, str]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if isinstance(params, dict):
        return params, "rope_parameters"
    return cfg.get("rope_scaling") or {}, "rope_scaling"


def parse_rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from config.json; original_max_position_embeddings and factor default as transformers'."""
    scaling, field = _rope_dict(cfg)
    theta = float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "su":  # Phi-3's name of longrope before transformers renamed it
        kind = "longrope"
    if kind == "default":
        return theta, None
    if kind in REFUSED:
        raise HFConfigError(f"{field}.rope_type {kind!r} is not supported: {REFUSED[kind]}")
    if kind not in ROPE_TYPES:
        raise HFConfigError(f"{field}.rope_type {kind!r} is not supported (one of default, {', '.join(ROPE_TYPES)})")
    max_pos = cfg.get("max_position_embeddings")
    # Phi-3 keeps the pretraining length beside rope_scaling, and transformers prefers it there
    original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
        or max_pos
    factor = scaling.get("factor")
    if factor is None and kind in ("yarn", "longrope") and max_pos and original:
        factor = max_pos / original
    if factor is None and kind != "longrope":
        raise HFConfigError(f"{field}.factor is missing for rope_type {kind!r}")
    keys = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
            "short_factor", "long_factor", "low_freq_factor", "high_freq_factor")
    extra = {k: scaling[k] for k in keys if scaling.get(k) is not None}
    if kind == "longrope" and not ("short_factor" in extra and "long_factor" in extra):
        raise HFConfigError(f"{field} longrope needs short_factor and long_factor")
    if kind == "llama3" and not ("low_freq_factor" in extra and "high_freq_factor" in extra):
        raise HFConfigError(f"{field} llama3 needs low_freq_factor and high_freq_factor")
    if original is None:
        raise HFConfigError(f"{field}.original_max_position_embeddings is missing (and max_position_embeddings)")
    return theta, RopeScaling(rope_type=kind, factor=float(factor if factor is not None else 1.0),
                              original_max_position_embeddings=int(original), **extra)


def refuse(cfg: dict, field: str, supported: str) -> None:
    """One line naming ``field`` and its value when it is set."""
    raise HFConfigError(f"{field} {cfg.get(field)!r} is not supported for model_type {cfg.get('model_type')!r} "
                        f"({supported})")


def check_common(cfg: dict, act: str = "silu", biases: tuple[str, ...] = ("attention_bias", "mlp_bias")) -> None:
    """Refuse what no Llama-shaped family here computes: another activation, biases, non-full layers."""
    if cfg.get("hidden_act", act) != act:
        refuse(cfg, "hidden_act", act)
    for key in biases:
        if cfg.get(key):
            refuse(cfg, key, "false")
    layer_types = [t for t in cfg.get("layer_types") or [] if t not in ("full_attention", "sliding_attention")]
    if layer_types:
        raise HFConfigError(f"layer_types contains {layer_types[0]!r}: only full_attention and sliding_attention "
                            f"layers are supported")


def base_args(cfg: dict, family: str, default_head_dim: int | None = None, sliding_window: int = 0,
              **flags) -> DecoderArgs:
    """DecoderArgs from the fields every Llama-shaped config.json has."""
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or default_head_dim or dim // n_heads)
        theta, scaling = parse_rope(cfg)
        rope, _ = _rope_dict(cfg)
        rotary = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0)
        return DecoderArgs(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), vocab_size=int(cfg["vocab_size"]),
            ffn_hidden_dim=int(cfg["intermediate_size"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim_override=0 if head_dim * n_heads == dim else head_dim, family=family,
            rotary_fraction=rotary, sliding_window=int(sliding_window or 0), pad_token_id=_pad(cfg), **flags,
        )
    except KeyError as e:
        raise HFConfigError(f"no {e.args[0]} in config.json") from e
    except (TypeError, ValueError) as e:
        raise HFConfigError(str(e)) from e


def _pad(cfg: dict) -> int | None:
    pad = cfg.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < int(cfg["vocab_size"]) else None


def llama_tensors(args: DecoderArgs) -> HFTensors:
    """Llama's names (Mistral, Qwen2/3 too): q/k rows RoPE-ordered, plus biases / q-k norms when present."""
    out: HFTensors = {"model.embed_tokens.weight": [("tok_embeddings.weight", 0)],
                      "model.norm.weight": [("norm.weight", 0)]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = [("output.weight", 0)]
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": ("attention.wq.weight", args.n_heads),
            "self_attn.k_proj.weight": ("attention.wk.weight", args.n_kv_heads),
            "self_attn.v_proj.weight": ("attention.wv.weight", 0),
            "self_attn.o_proj.weight": ("attention.wo.weight", 0),
            "mlp.gate_proj.weight": ("feed_forward.w1.weight", 0),
            "mlp.up_proj.weight": ("feed_forward.w3.weight", 0),
            "mlp.down_proj.weight": ("feed_forward.w2.weight", 0),
            "input_layernorm.weight": ("attention_norm.weight", 0),
            "post_attention_layernorm.weight": ("ffn_norm.weight", 0),
        }
        if args.qkv_bias:
            layer.update({"self_attn.q_proj.bias": ("attention.wq.bias", args.n_heads),
                          "self_attn.k_proj.bias": ("attention.wk.bias", args.n_kv_heads),
                          "self_attn.v_proj.bias": ("attention.wv.bias", 0)})
        if args.qk_norm:  # one shared "head" of head_dim entries
            layer.update({"self_attn.q_norm.weight": ("attention.q_norm.weight", 1),
                          "self_attn.k_norm.weight": ("attention.k_norm.weight", 1)})
        for hf_name, (name, heads) in layer.items():
            out[theirs + hf_name] = [(ours + name, heads)]
    return out


def rope_config(args: DecoderArgs) -> dict | None:
    """config.json's ``rope_scaling`` for ``args`` (None: plain RoPE)."""
    s = args.rope_scaling
    if s is None:
        return None
    out = {"rope_type": s.rope_type, "factor": s.factor,
           "original_max_position_embeddings": s.original_max_position_embeddings}
    if s.rope_type == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    elif s.rope_type == "linear":
        del out["original_max_position_embeddings"]  # not a linear-scaling key (transformers warns)
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                "short_factor", "long_factor"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    return out


def qk_norm_bytes(args: DecoderArgs, layout, switches, mode: str) -> float:
    """Bytes per local token that per-head q/k norms (Qwen3, Gemma 3) keep beyond the decoder's memory terms:
    without AC, their inputs (the q/k projections' outputs, which RoPE alone frees) and an fp32 scale per head.
    AC recomputes them (selective too: no matmul), and so does each head stage (a checkpoint of its own)."""
    if not args.qk_norm or mode != "none" or switches.head_stages > 1:
        return 0.0
    heads = (args.n_heads + args.n_kv_heads) // layout.tp
    return (switches.act_bytes * args.head_dim + 4) * heads
