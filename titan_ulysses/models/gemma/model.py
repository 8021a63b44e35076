"""Gemma 3 text and Gemma 2: Llama's parts with Gemma's differences, as a block of its own.

* RMSNorm scales by ``1 + w`` (weights start at zero), computed in fp32 and then cast;
* four norms per block: before and after attention, before and after the MLP;
* the MLP is GeGLU with tanh-approximated GELU;
* q and k are RMS-normalised per head, scores scaled by ``query_pre_attn_scalar ** -0.5``;
* "sliding_attention" layers see ``sliding_window`` keys and use the local RoPE base,
  "full_attention" layers see everything and use the global one (with its scaling);
* embeddings are multiplied by ``sqrt(dim)`` (in their dtype), and tied to the output;
* Gemma 2: no q/k norms, attention scores and final logits soft-capped (``c * tanh(x / c)``).

Names of the projections (wq ... w3) and of ``inner_attention`` are Llama's, so TP, Ulysses,
cp, AC, compile and FSDP lay it out unchanged. Nothing here is distributed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.gemma.args import GemmaArgs
from titan_ulysses.models.decoder.attention import Attention
from titan_ulysses.models.decoder.feed_forward import FeedForward
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.rope import rope_frequencies
from titan_ulysses.ops.loss import cross_entropy_sum
from titan_ulysses.ops.tiled import tiled_apply


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self):
        nn.init.zeros_(self.weight)


class GemmaAttention(Attention):
    def __init__(self, args: GemmaArgs, layer_type: str, compute: ComputeOptions):
        super().__init__(args, compute)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None  # Gemma 3
        self.k_norm = GemmaRMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.attention_kwargs = {"scale": args.query_pre_attn_scalar ** -0.5}
        if args.attn_softcap:  # Gemma 2 (backends without softcap are refused by registry.check_compute)
            self.attention_kwargs["softcap"] = args.attn_softcap
        if layer_type == "sliding_attention" and args.sliding_window:
            self.attention_kwargs["window"] = args.sliding_window


class GeGLU(FeedForward):
    def geglu(self, x):  # [B, S, D] -> [B, S, D] via [B, S, ffn_hidden]
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))

    def forward(self, x):
        return tiled_apply(self, self.geglu, x, self.tile_size)


class GemmaBlock(nn.Module):
    def __init__(self, layer_id: int, args: GemmaArgs, compute: ComputeOptions):
        super().__init__()
        self.layer_type = args.layer_types[layer_id]
        self.attention = GemmaAttention(args, self.layer_type, compute)
        self.feed_forward = GeGLU(args.dim, args.ffn_hidden_dim, compute.mlp_tile_size)
        self.attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_attention_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.post_ffn_norm = GemmaRMSNorm(args.dim, args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, ropes, attention_mask=None):  # [B, S, D]
        rope = ropes[self.layer_type]
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, attention_mask))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))

    def init_weights(self):
        for norm in (self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class GemmaTransformer(Transformer):
    def __init__(self, args: GemmaArgs, compute: ComputeOptions | None = None):
        super().__init__(args, compute)
        self.layers = nn.ModuleDict({str(i): GemmaBlock(i, args, self.compute) for i in range(args.n_layers)})
        self.norm = GemmaRMSNorm(args.dim, args.norm_eps)
        inv_freq, self.local_attention_factor = rope_frequencies(args.rotary_dim, args.local_rope_theta,
                                                                 args.local_rope_scaling)
        self.register_buffer("rope_local_inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor):
        """cos, sin per layer type: the full layers' (global base, scaling) and the sliding layers' (local base)."""
        full = super().rope(positions)
        if positions.dim() == 1:
            positions = positions[None]
        angles = positions[..., None].float() * self.rope_local_inv_freq  # [B, S, Dr/2]
        cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
        if self.local_attention_factor != 1.0:
            cos, sin = cos * self.local_attention_factor, sin * self.local_attention_factor
        return {"full_attention": full, "sliding_attention": (cos, sin)}

    def embed(self, tokens):
        h = self.tok_embeddings(tokens)  # [B, S, D]
        return h * torch.tensor(self.args.dim ** 0.5, dtype=h.dtype)  # the scale rounded to h's dtype, as HF

    def head(self, h, weight, labels=None):
        if not self.args.final_softcap:
            return super().head(h, weight, labels)
        c = self.args.final_softcap
        logits = c * torch.tanh(F.linear(h, weight) / c)  # [B, S, vocab]: all of them (no chunking with softcap)
        return logits if labels is None else cross_entropy_sum(logits, labels)

    def init_buffers(self, buffer_device: torch.device | None = None):
        super().init_buffers(buffer_device)
        args = self.args
        self.rope_local_inv_freq = rope_frequencies(args.rotary_dim, args.local_rope_theta, args.local_rope_scaling)[
            0].to(self.rope_inv_freq.device)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None):
        super().init_weights(buffer_device)
        self.init_buffers(buffer_device)
