"""The decoder's attention: q/k/v projections, per-head q/k norms, RoPE, a swappable ``inner_attention``, out.

It derives from ``ops/attention/contracts.HeadAttention``, all that code outside the decoder relies
on (``distributed/staged_attention.py`` recomputes the layer head group by head group through it);
Ulysses and cp swap ``inner_attention``.
Shapes: B batch, S the local sequence length (S_total / sp under Ulysses), H heads (local
to a tensor-parallel rank), Dh head dim, D model dim.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.norm import RMSNorm
from titan_ulysses.ops.attention import build_attention
from titan_ulysses.ops.attention.contracts import HeadAttention, HeadProjections


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


class Attention(HeadAttention):
    def __init__(self, args: DecoderArgs, compute: ComputeOptions, layer_type: str = "full_attention",
                 norm_offset: float = 0.0):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=args.o_bias)
        # gpt-oss: a logit per q head beside every row's scores (a backend capability: registry.check_compute)
        self.sinks = nn.Parameter(torch.empty(args.n_heads)) if args.attn_sinks else None
        # Qwen3, Gemma 3: one RMSNorm over head_dim shared by all q heads (and one by all k heads)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, norm_offset) if args.qk_norm else None
        self.inner_attention = build_attention(compute.attn_backend, compute.sdpa_backends)
        # only what a layer needs is passed (the fixed inner_attention interface; registry.check_compute
        # refuses a backend without the capability)
        self.attention_kwargs = {}
        if args.query_pre_attn_scalar:
            self.attention_kwargs["scale"] = args.query_pre_attn_scalar ** -0.5
        if args.attn_softcap:
            self.attention_kwargs["softcap"] = args.attn_softcap
        if layer_type == "sliding_attention" and args.sliding_window:
            self.attention_kwargs["window"] = args.sliding_window

    def projections(self) -> HeadProjections:
        return HeadProjections(self.wq, self.wk, self.wv, self.wo)

    def prepare_qk(self, q, k, rope):
        """q ``[B, S, Hq, Dh]`` and k ``[B, S, Hkv, Dh]`` as the kernel takes them: per-head norms, then RoPE."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, *rope), apply_rope(k, *rope)

    def forward(self, x, rope, attention_mask):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # [B, S, Hq, Dh]
        k = self.wk(x).view(b, s, -1, self.head_dim)  # [B, S, Hkv, Dh]
        v = self.wv(x).view(b, s, -1, self.head_dim)  # [B, S, Hkv, Dh]
        q, k = self.prepare_qk(q, k, rope)
        kwargs = self.attention_kwargs if self.sinks is None else {**self.attention_kwargs, "sinks": self.sinks}
        out = self.inner_attention(q, k, v, attention_mask, **kwargs)  # [B, S, Hq, Dh]
        return self.wo(out.reshape(b, s, -1))

    def init_weights(self, std: float):
        for w in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(w.weight, std=0.02)
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        nn.init.trunc_normal_(self.wo.weight, std=std)
        if self.wo.bias is not None:
            nn.init.zeros_(self.wo.bias)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
