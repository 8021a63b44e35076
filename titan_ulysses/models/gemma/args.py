"""Gemma 2 / Gemma 3 text model arguments: Llama's, plus what their block does differently."""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling


@dataclass
class GemmaArgs(DecoderArgs):
    layer_types: list[str] = field(default_factory=list)
    """Per layer "sliding_attention" (window ``sliding_window``, local RoPE) or "full_attention"."""
    local_rope_theta: float = 10000.0
    """RoPE base of the sliding layers (``rope_theta`` / ``rope_scaling`` are the full layers')."""
    local_rope_scaling: RopeScaling | None = None
    """RoPE scaling of the sliding layers (None on every Gemma 3 release)."""
    query_pre_attn_scalar: float = 256.0
    """Attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5."""
    attn_softcap: float = 0.0
    """Gemma 2: scores -> attn_softcap * tanh(scores / attn_softcap) before the mask (0: off)."""
    final_softcap: float = 0.0
    """Gemma 2: logits -> final_softcap * tanh(logits / final_softcap) (0: off)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        bad = [t for t in self.layer_types if t not in ("sliding_attention", "full_attention")]
        if bad:
            raise ValueError(f"layer_types contains {bad[0]!r} (sliding_attention or full_attention)")

    def num_params(self) -> int:  # two more norms per block
        return super().num_params() + self.n_layers * 2 * self.dim
