"""The decoder's arguments: every shape and option a family's config.json sets (``models/families/``).

Qwen3 and Qwen2/2.5 are the Llama decoder with a few flags (``qk_norm``,
``head_dim_override``, ``qkv_bias``); ``models/hf_config.py`` reads them from a Hugging
Face ``config.json``. The named shapes (``model.flavor``) are in ``models/flavors.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RopeScaling:
    """RoPE frequency scaling for long context, as config.json's ``rope_scaling`` / ``rope_parameters``
    (``models/rope.py`` computes it; a record without ``rope_type`` is Llama 3.1's)."""

    factor: float = 8.0
    """How much longer than ``original_max_position_embeddings`` the context becomes."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original / low_freq_factor are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """The context length the model was pretrained at."""
    rope_type: str = "llama3"
    """"llama3", "yarn", "linear" or "longrope" (models/rope.py ROPE_TYPES)."""
    attention_factor: float | None = None
    """yarn / longrope: scale of cos and sin (None: computed from ``factor`` as transformers does)."""
    beta_fast: float | None = None
    """yarn: ramp boundary for extrapolation (None: 32)."""
    beta_slow: float | None = None
    """yarn: ramp boundary for interpolation (None: 1)."""
    mscale: float | None = None
    """yarn: numerator mscale of the attention factor (with ``mscale_all_dim``)."""
    mscale_all_dim: float | None = None
    """yarn: denominator mscale of the attention factor."""
    truncate: bool | None = None
    """yarn: round the correction range to whole dims (None: true, transformers' default)."""
    short_factor: list[float] | None = None
    """longrope: per-frequency divisors used up to ``original_max_position_embeddings``."""
    long_factor: list[float] | None = None
    """longrope: per-frequency divisors used beyond it."""


@dataclass
class DecoderArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_hidden_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    tie_embeddings: bool = False
    head_dim_override: int = 0
    """Per-head dim when it is not dim // n_heads (Qwen3, some Llama configs); 0: dim // n_heads."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm over head_dim of every q and k head before RoPE (Qwen3)."""
    family: str = "llama"
    """Hugging Face ``model_type`` of the model (models/registry.py): its adapter and export config."""
    rotary_fraction: float = 1.0
    """Fraction of each head's features RoPE rotates (Phi-4-mini's ``partial_rotary_factor``)."""
    pad_token_id: int | None = None
    """Embedding row that gets no gradient (Hugging Face builds its embedding with this padding_idx)."""
    sliding_window: int = 0
    """Keys a query sees (its own included) on every layer, Hugging Face's ``sliding_window``; 0: all."""
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Leading features of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.rotary_fraction)

    def __post_init__(self) -> None:
        if not self.head_dim_override and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} (rotary {self.rotary_dim}) must be even for RoPE")

    def num_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += self.qkv_bias * self.head_dim * (self.n_heads + 2 * self.n_kv_heads) + self.qk_norm * 2 * self.head_dim
        mlp = 3 * self.dim * self.ffn_hidden_dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + 2 * self.dim) + emb + self.dim
