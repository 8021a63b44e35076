"""The decoder's block: pre-norm attention and feed-forward around the residual stream."""

from __future__ import annotations

from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.attention import Attention
from titan_ulysses.models.decoder.feed_forward import FeedForward
from titan_ulysses.models.decoder.norm import RMSNorm


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
