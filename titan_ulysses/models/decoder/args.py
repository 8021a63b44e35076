"""The decoder's arguments: every shape and option a family's config.json sets (``models/families/``).

Qwen3 and Qwen2/2.5 are the Llama decoder with a few flags (``qk_norm``,
``head_dim_override``, ``qkv_bias``); ``interop/hf_config.py`` reads them from a Hugging
Face ``config.json``. The named shapes (``model.flavor``) are in ``models/flavors.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_ulysses.models.moe.args import MoEArgs


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
    """Keys a query sees (its own included) on a sliding layer, Hugging Face's ``sliding_window``; 0: all."""
    layer_types: list[str] = field(default_factory=list)
    """Per layer "sliding_attention" (``sliding_window``, the local RoPE when set) or "full_attention" (Gemma);
    empty: every layer sliding when ``sliding_window`` is set (Mistral), else full."""
    local_rope_theta: float = 0.0
    """RoPE base of the sliding layers (``rope_theta`` / ``rope_scaling`` are the full layers'); 0: theirs."""
    local_rope_scaling: RopeScaling | None = None
    """RoPE scaling of the sliding layers, with ``local_rope_theta``."""
    query_pre_attn_scalar: float = 0.0
    """Attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma); 0: head_dim ** -0.5."""
    attn_softcap: float = 0.0
    """Scores -> attn_softcap * tanh(scores / attn_softcap) before the mask (Gemma 2); 0: off."""
    final_softcap: float = 0.0
    """Logits -> final_softcap * tanh(logits / final_softcap) (Gemma 2); 0: off."""
    o_bias: bool = False
    """A bias on the output projection (gpt-oss's ``attention_bias`` covers o_proj too)."""
    attn_sinks: bool = False
    """A learned logit per q head in every softmax's denominator (gpt-oss's ``sinks``)."""
    moe: MoEArgs | None = None
    """The mixture-of-experts feed-forward (``models/moe/``); None: the dense MLP everywhere."""
    moe_dense_layers: list[int] = field(default_factory=list)
    """Layers that keep the dense MLP of ``ffn_hidden_dim`` in an MoE model (Qwen3-MoE's ``mlp_only_layers``
    and ``decoder_sparse_step``)."""

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """Leading features of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def local_rope(self) -> bool:
        """Whether the sliding layers have a RoPE of their own."""
        return bool(self.local_rope_theta) and "sliding_attention" in self.layer_types

    def layer_type(self, layer_id: int) -> str:
        """"sliding_attention" or "full_attention": the keys and the RoPE of layer ``layer_id``."""
        if self.layer_types:
            return self.layer_types[layer_id]
        return "sliding_attention" if self.sliding_window else "full_attention"

    def __post_init__(self) -> None:
        if not self.head_dim_override and self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} (rotary {self.rotary_dim}) must be even for RoPE")
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.n_layers} layers")
        bad = [t for t in self.layer_types if t not in ("sliding_attention", "full_attention")]
        if bad:
            raise ValueError(f"layer_types contains {bad[0]!r} (sliding_attention or full_attention)")

