"""The range of every number config.json gives the model, checked before the model is built.

config.json is checked as strictly as the TOML (``config/ranges.py``). An impossible number
there (a yarn factor of -4, a rope_theta of 0, a negative rms_norm_eps, num_key_value_heads 0)
would otherwise train on wrong positions or end in a NaN loss at step 1 naming neither the file
nor the field. The RoPE rules are transformers' own (``modeling_rope_utils``'s
``_validate_*_rope_parameters``, which only log a warning): every scaling factor >= 1,
llama3's high_freq_factor above its low_freq_factor, yarn's beta_fast at least its beta_slow,
longrope's short_factor and long_factor one entry per rotary frequency. A mixture of experts'
fields likewise (``check_moe_fields``): at least one expert, top-k between 1 and the expert count,
every key its family needs present, and a load-balancing weight in [0, 1] (1e30 passed and stopped
the run at step 1; the largest released weight is 0.02).
"""

from __future__ import annotations

import math

from titan_ulysses.config.ranges import out_of_range
from titan_ulysses.models.registry import HFConfigError

POSITIVE = (0, None, False, False)
NON_NEGATIVE = (0, None, True, False)
FRACTION = (0, 1, False, True)
AT_LEAST_ONE = (1, None, True, False)
AUX_WEIGHT = (0, 1, True, True)  # released: 0.001 to 0.02; the unweighted loss is about top-k when balanced

# field -> (bounds, whole number); an absent or null field takes the family's default
FIELDS: dict[str, tuple[tuple, bool]] = {
    "hidden_size": (POSITIVE, True),
    "num_attention_heads": (POSITIVE, True),
    "num_key_value_heads": (POSITIVE, True),  # null: one per query head, as transformers
    "num_hidden_layers": (POSITIVE, True),
    "intermediate_size": (POSITIVE, True),
    "vocab_size": (POSITIVE, True),
    "head_dim": (POSITIVE, True),
    "max_position_embeddings": (POSITIVE, True),
    "original_max_position_embeddings": (POSITIVE, True),
    "rms_norm_eps": (POSITIVE, False),  # 0 divides by zero on the zero embedding row of padding
    "rope_theta": (POSITIVE, False),
    "rope_local_base_freq": (POSITIVE, False),
    "partial_rotary_factor": (FRACTION, False),
    "sliding_window": (NON_NEGATIVE, True),  # 0 / null: no window
    "sliding_window_pattern": (POSITIVE, True),
    "query_pre_attn_scalar": (POSITIVE, False),
    "attn_logit_softcapping": (NON_NEGATIVE, False),  # 0 / null: no cap
    "final_logit_softcapping": (NON_NEGATIVE, False),
    # mixtures of experts (0 experts: Qwen3-MoE's dense model; top-k against the count: check_moe_fields)
    "num_experts": (NON_NEGATIVE, True),
    "num_local_experts": (NON_NEGATIVE, True),
    "num_experts_per_tok": (POSITIVE, True),
    "moe_intermediate_size": (POSITIVE, True),
    "decoder_sparse_step": (POSITIVE, True),
    "router_aux_loss_coef": (AUX_WEIGHT, False),
}
# inside rope_scaling / rope_parameters (``factor`` is checked by rope type)
ROPE_FIELDS: dict[str, tuple[tuple | None, bool]] = {
    "rope_theta": (POSITIVE, False),
    "original_max_position_embeddings": (POSITIVE, True),
    "attention_factor": (POSITIVE, False),
    "beta_fast": (POSITIVE, False),
    "beta_slow": (POSITIVE, False),
    "mscale": (None, False),
    "mscale_all_dim": (None, False),
    "low_freq_factor": (POSITIVE, False),
    "high_freq_factor": (POSITIVE, False),
    "partial_rotary_factor": (FRACTION, False),
}


def _number(where: str, field: str, value, bounds: tuple | None, whole: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{where}: {field} must be a number, got {value!r}")
    if whole and isinstance(value, float) and math.isfinite(value) and not value.is_integer():
        raise HFConfigError(f"{where}: {field} must be a whole number, got {value!r}")
    refusal = out_of_range(field, value, bounds)
    if refusal:
        raise HFConfigError(f"{where}: {refusal}")


def rope_dicts(cfg: dict) -> list[tuple[str, dict]]:
    """(field name, dict) of every RoPE settings dict: rope_scaling, rope_parameters or its per-layer-type dicts."""
    out = []
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if not isinstance(value, dict):
            continue
        nested = [(f"{key}.{name}", sub) for name, sub in value.items() if isinstance(sub, dict)]
        out += nested or [(key, value)]
    return out


def rope_kind(params: dict) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    return "longrope" if kind == "su" else kind  # Phi-3's name of longrope before transformers renamed it


def _check_rope(where: str, field: str, params: dict) -> None:
    kind = rope_kind(params)
    for name, (bounds, whole) in ROPE_FIELDS.items():
        if params.get(name) is not None:
            _number(where, f"{field}.{name}", params[name], bounds, whole)
    factor = params.get("factor")
    if factor is not None and kind != "default":
        _number(where, f"{field}.factor", factor, None, False)
        if factor < 1:
            raise HFConfigError(f"{where}: {field}.factor must be >= 1 for rope_type {kind!r} (as transformers "
                                f"requires: it is how many times longer the context becomes), got {factor!r}")
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    if kind == "llama3" and low is not None and high is not None and high <= low:
        raise HFConfigError(f"{where}: {field}.high_freq_factor {high!r} must be greater than low_freq_factor "
                            f"{low!r} (as transformers requires)")
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    if kind == "yarn" and fast < slow:
        raise HFConfigError(f"{where}: {field}.beta_fast {fast!r} must be at least beta_slow {slow!r} (as "
                            f"transformers requires; null means 32 and 1)")
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if kind == "longrope" and values is not None:
            if not isinstance(values, list):
                raise HFConfigError(f"{where}: {field}.{name} must be a list of numbers, got {values!r}")
            for i, v in enumerate(values):
                _number(where, f"{field}.{name}[{i}]", v, POSITIVE, False)


def check_hf_ranges(cfg: dict, where: str = "config.json") -> None:
    """Refuse the first number of ``cfg`` outside its range, naming ``where`` and the field."""
    for field, (bounds, whole) in FIELDS.items():
        if cfg.get(field) is not None:
            _number(where, field, cfg[field], bounds, whole)
    for field, params in rope_dicts(cfg):
        _check_rope(where, field, params)


def check_rope_lengths(cfg: dict, rotary_dim: int, where: str = "config.json") -> None:
    """longrope's factor lists hold one divisor per rotary frequency (``rotary_dim / 2``), as transformers requires."""
    for field, params in rope_dicts(cfg):
        if rope_kind(params) != "longrope":
            continue
        for name in ("short_factor", "long_factor"):
            values = params.get(name)
            if isinstance(values, list) and len(values) != rotary_dim // 2:
                raise HFConfigError(
                    f"{where}: {field}.{name} has {len(values)} entries; longrope needs one per rotary frequency, "
                    f"{rotary_dim // 2} (half the rotary dim {rotary_dim} of head_dim x partial_rotary_factor)")



def check_moe_fields(moe, cfg: dict, where: str = "config.json") -> None:
    """The experts a family built from ``cfg`` (``moe``: its MoEArgs, None for a dense model) can route: at
    least one expert, and ``num_experts_per_tok`` at most their count (0 trained with the experts doing
    nothing; 9 of 8 was a torch.topk traceback at the first step)."""
    if moe is None:
        return
    count = next((k for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None), "")
    experts = f"{count} {moe.num_experts}" if count else f"{moe.num_experts} experts, the family's default"
    if moe.num_experts < 1:
        raise HFConfigError(f"{where}: {experts}: a mixture of experts needs at least one expert")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise HFConfigError(f"{where}: num_experts_per_tok {moe.top_k} must lie in [1, {moe.num_experts}] (experts "
                            f"each token goes to, of {experts})")
