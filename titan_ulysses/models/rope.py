"""RoPE frequencies per ``rope_type``, as transformers computes them (``modeling_rope_utils``).

Each function maps (rotary dim, theta, scaling) to ``(inv_freq [rotary_dim/2] fp32,
attention_factor)``; cos and sin are multiplied by ``attention_factor`` (yarn, longrope).
``dynamic`` (NTK) is not here: it changes the frequencies with the length of each
inference call, so there is no single function of position to train.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from titan_ulysses.models.decoder.args import RopeScaling


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / dim), i < dim / 2, in float64 (rounded once at the end)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _llama3(dim: int, theta: float, s: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    inv_freq = default_inv_freq(dim, theta)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    inv_freq = torch.where(wavelen > low_wavelen, inv_freq / s.factor,
                           torch.where(wavelen < high_wavelen, inv_freq, blended))
    return inv_freq, 1.0


def _linear(dim: int, theta: float, s: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    return default_inv_freq(dim, theta) / s.factor, 1.0  # positions divided by `factor`


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies extrapolated, low ones interpolated by `factor`, a linear ramp between."""
    factor = s.factor
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).double()
    extrapolated = default_inv_freq(dim, theta)
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv_freq, float(attention_factor)


def _longrope(dim: int, theta: float, s: RopeScaling, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency divisors, the long ones beyond the original context."""
    factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float64)
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if s.factor <= 1 else math.sqrt(
            1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))
    return default_inv_freq(dim, theta) / factors, float(attention_factor)


ROPE_TYPES: dict[str, Callable[[int, float, RopeScaling, bool], tuple[torch.Tensor, float]]] = {
    "llama3": _llama3,
    "linear": _linear,
    "yarn": _yarn,
    "longrope": _longrope,
}
REFUSED = {"dynamic": "it rescales RoPE by the length of each inference call (no fixed positions to train); "
                      "use yarn or linear"}


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None,
                     long: bool = False) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] fp32, attention_factor)``; ``long`` picks longrope's long factors."""
    if scaling is None:
        return default_inv_freq(dim, theta).float(), 1.0
    inv_freq, attention_factor = ROPE_TYPES[scaling.rope_type](dim, theta, scaling, long)
    return inv_freq.float(), attention_factor


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` (short factors for longrope)."""
    return rope_frequencies(head_dim, theta, scaling)[0]
