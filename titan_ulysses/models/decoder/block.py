"""The decoder's block: attention and feed-forward around the residual stream, each after its norm.

With ``DecoderSpec.sandwich_norms`` (Gemma) each also passes a norm of its own before it joins
the residual. The feed-forward comes from the family's builder (``feed_forward.py``), and may
return an auxiliary loss beside its output.
"""

from __future__ import annotations

from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.attention import Attention
from titan_ulysses.models.decoder.norm import RMSNorm
from titan_ulysses.models.decoder.spec import DecoderSpec


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: DecoderArgs, compute: ComputeOptions, spec: DecoderSpec):
        super().__init__()
        self.layer_type = args.layer_type(layer_id)
        """Which of the model's RoPE tables (``Transformer.rope``) and keys this layer uses."""
        offset = spec.norm_offset
        self.attention = Attention(args, compute, self.layer_type, offset)
        self.feed_forward = spec.feed_forward(layer_id, args, compute)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, offset)
        self.post_attention_norm = RMSNorm(args.dim, args.norm_eps, offset) if spec.sandwich_norms else None
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, offset)
        self.post_ffn_norm = RMSNorm(args.dim, args.norm_eps, offset) if spec.sandwich_norms else None
        # depth-scaled init of the projections that write into the residual stream
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x, rope, attention_mask=None):  # [B, S, D]
        if isinstance(rope, dict):  # sliding layers with a RoPE of their own
            rope = rope[self.layer_type]
        # no local holds the attention output: it would live on through the feed-forward, a [B, S, D]
        # more at the block's peak (issue 39: 2.9 GiB of the 8B at 6M's tracked peak over sp=8)
        h = x + _after(self.post_attention_norm, self.attention(self.attention_norm(x), rope, attention_mask))
        f = self.feed_forward(self.ffn_norm(h))  # [B, S, D], or with its statistics ([B, S, D], stats)
        f, stats = f if isinstance(f, tuple) else (f, None)
        h = h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))
        return h if stats is None else (h, stats)

    def init_weights(self):
        for norm in (self.attention_norm, self.post_attention_norm, self.ffn_norm, self.post_ffn_norm):
            if norm is not None:
                norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


def each_block(layers: nn.ModuleDict):
    """The units forward runs in turn, each ``(h [B, S, D], rope, attention_mask) -> h`` or ``(h, stats)``
    (a feed-forward's, ``feed_forward.py``): every block."""
    return layers.values()


def _after(norm, t):  # [B, S, D]: a sandwich norm's output, or t as it is
    return t if norm is None else norm(t)
