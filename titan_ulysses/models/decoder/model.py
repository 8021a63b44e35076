"""Llama 3: RMSNorm, RoPE (Llama 3.1 scaling), GQA attention, SwiGLU.

Qwen3 adds an RMSNorm per q/k head before RoPE (``args.qk_norm``) and a head_dim of its
own (``args.head_dim_override``); Qwen2/2.5 adds q/k/v biases (``args.qkv_bias``).

Nothing here is distributed. Parallelism is applied from outside
(``parallelize.py``): tensor parallelism slices the projections (so head counts
are inferred from shapes, never stored), Ulysses swaps ``inner_attention``.

Shapes: B batch, S the local sequence length (S_total / sp under Ulysses),
H heads (local to a tensor-parallel rank), Dh head dim, D model dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling
from titan_ulysses.models.rope import rope_frequencies
from titan_ulysses.ops.attention import build_attention
from titan_ulysses.ops.loss import linear_cross_entropy_sum
from titan_ulysses.ops.norm import rms_norm
from titan_ulysses.ops.tiled import tiled_apply


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` (short factors for longrope); see ``models/rope.py``."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x: [B, S, H, Dh]`` by the angles of ``cos, sin: [B or 1, S, 1, Dr/2]``.

    With ``Dr < Dh`` (partial rotary) the features past ``Dr`` pass through unrotated.
    """
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x_ = x.float().unflatten(-1, (-1, 2))  # [B, S, H, Dh/2, 2]
    x0, x1 = x_[..., 0], x_[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # computed in fp32; keeps x and one fp32 scale per token (ops/norm.py)
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs, compute: ComputeOptions):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # Qwen3: one RMSNorm over head_dim shared by all q heads (and one by all k heads)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.inner_attention = build_attention(compute.attn_backend, compute.sdpa_backends)
        # only a windowed layer passes window= (the fixed inner_attention interface)
        self.attention_kwargs = {"window": args.sliding_window} if args.sliding_window else {}

    def forward(self, x, rope, attention_mask):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [B, S, Hq, Dh]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [B, S, Hkv, Dh]
        v = self.wv(x).view(b, s, -1, self.head_dim)  # [B, S, Hkv, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = self.inner_attention(q, k, v, attention_mask, **self.attention_kwargs)  # [B, S, Hq, Dh]
        return self.wo(out.reshape(b, s, -1))

    def init_weights(self, std: float):
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=0.02)
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        nn.init.trunc_normal_(self.wo.weight, std=std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, tile_size: int = 0):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.tile_size = tile_size

    def swiglu(self, x):  # [B, S, D] -> [B, S, D] via [B, S, ffn_hidden]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def forward(self, x):
        return tiled_apply(self, self.swiglu, x, self.tile_size)

    def init_weights(self, std: float):
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w.weight, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DecoderArgs, compute: ComputeOptions):
        super().__init__()
        self.attention = Attention(args, compute)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim, compute.mlp_tile_size)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # depth-scaled init of the projections that write into the residual stream
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, rope, attention_mask=None):  # [B, S, D]
        h = x + self.attention(self.attention_norm(x), rope, attention_mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self):
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


def each_block(layers: nn.ModuleDict):
    """The units forward runs in turn, each ``(h [B, S, D], rope, attention_mask) -> h``: every block."""
    return layers.values()


class Transformer(nn.Module):
    def __init__(self, args: DecoderArgs, compute: ComputeOptions | None = None):
        super().__init__()
        self.args = args
        self.compute = compute = compute or ComputeOptions()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.pad_token_id)
        # ModuleDict keeps fully-qualified names stable when blocks are wrapped or dropped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, compute) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        inv_freq, self.rope_attention_factor = rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.longrope = args.rope_scaling is not None and args.rope_scaling.rope_type == "longrope"
        self.register_buffer("rope_long_inv_freq", self._long_inv_freq(), persistent=False)
        self.layer_units = each_block
        """``self.layers`` -> what forward runs in turn (a plain attribute, not a module: no parameter name
        changes); activation checkpointing in groups of blocks replaces it (``distributed/activation_checkpoint.py``)."""
        self.rope_seq_len = 0
        """Full sequence length for longrope's choice of factors (0: the last of the local positions + 1,
        right in one process; under Ulysses / cp the trainer sets it to training.seq_len)."""

    def _long_inv_freq(self) -> torch.Tensor | None:
        args = self.args
        return rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling, long=True)[0] \
            if self.longrope else None

    def rope(self, positions: torch.Tensor):
        """cos, sin of ``positions`` ([S] or [B, S], global token indices) as [B or 1, S, 1, Dr/2] fp32."""
        if positions.dim() == 1:
            positions = positions[None]
        inv_freq = self.rope_inv_freq
        if self.longrope:  # transformers: long factors once the sequence passes the original context
            original = self.args.rope_scaling.original_max_position_embeddings
            if self.rope_seq_len:
                inv_freq = self.rope_long_inv_freq if self.rope_seq_len > original else inv_freq
            else:  # like transformers: a traceable choice on the largest position
                inv_freq = torch.where(positions.max() + 1 > original, self.rope_long_inv_freq, inv_freq)
        angles = positions[..., None].float() * inv_freq  # [B, S, Dr/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        if self.rope_attention_factor != 1.0:  # yarn / longrope scale both (hence q.k by its square)
            cos, sin = cos * self.rope_attention_factor, sin * self.rope_attention_factor
        return cos, sin

    def forward(self, tokens, positions=None, attention_mask=None, labels=None):
        """``tokens: [B, S]`` -> logits ``[B, S, vocab]``, or with ``labels`` the summed cross-entropy.

        ``positions`` are the global positions of these tokens (default ``arange(S)``);
        under Ulysses each rank passes those of its own slice so RoPE is right everywhere.
        ``attention_mask`` comes from ``ops.attention.build_attention_mask`` (None: causal).
        With ``labels: [B, S]`` the output projection and the loss run together, in chunks
        of ``compute.loss_chunk_size`` tokens when set, so full logits never exist.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        rope = self.rope(positions)
        h = self.embed(tokens)  # [B, S, D]
        for unit in self.layer_units(self.layers):  # h is each unit's alone: an input held here would stay alive
            h = unit(h, rope, attention_mask)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight  # [V, D]
        return self.head(h, weight, labels)

    def head(self, h, weight, labels=None):
        """Logits ``[B, S, vocab]`` of the final hidden states, or with ``labels`` the summed loss."""
        if labels is not None:
            return linear_cross_entropy_sum(h, weight, labels, self.compute.loss_chunk_size)
        return F.linear(h, weight)  # [B, S, vocab]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def init_buffers(self, buffer_device: torch.device | None = None):
        """(Re)compute the non-persistent RoPE frequencies (garbage after ``to_empty``)."""
        args = self.args
        device = buffer_device or self.rope_inv_freq.device
        self.rope_inv_freq = rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling)[0].to(device)
        if self.longrope:
            self.rope_long_inv_freq = self._long_inv_freq().to(device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None):
        """(Re)initialise every parameter and buffer; call after ``to_empty`` when built on meta."""
        args = self.args
        self.init_buffers(buffer_device)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if self.output is not None else 0.02)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        if self.output is not None:
            cutoff = 3 * args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=args.dim**-0.5, a=-cutoff, b=cutoff)
