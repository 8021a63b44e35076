"""The decoder: embeddings, RoPE tables, the blocks (``block.py``), the final norm and the output (with the loss).

Llama 3 as it is: RMSNorm, RoPE (Llama 3.1 scaling), GQA attention, SwiGLU. What other
families change is an argument (``args.py``: Qwen3's per-head q/k norm and head_dim, Qwen2's
q/k/v biases, windows, Gemma's layer types, local RoPE, attention scale and softcaps) or part
of their ``DecoderSpec`` (``spec.py``: Gemma's norms, embedding scale and GeGLU).

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
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.block import TransformerBlock, each_block
from titan_ulysses.models.decoder.norm import RMSNorm
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.models.rope import rope_frequencies
from titan_ulysses.ops.layer_stats import add_stats
from titan_ulysses.ops.loss import linear_cross_entropy_sum, softcapped


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float):
    angles = positions[..., None].float() * inv_freq  # [B, S, Dr/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    if factor != 1.0:  # yarn / longrope scale both (hence q.k by its square)
        cos, sin = cos * factor, sin * factor
    return cos, sin


class Transformer(nn.Module):
    def __init__(self, args: DecoderArgs, compute: ComputeOptions | None = None, spec: DecoderSpec | None = None):
        """``spec``: what the family does differently; None: Llama's (``DecoderSpec()``, which the dense families
        that declare none share). ``models/registry.build_model`` passes ``args.family``'s: the decoder never
        looks a family up itself."""
        super().__init__()
        spec = DecoderSpec() if spec is None else spec
        if args.moe is not None and not spec.experts:
            raise ValueError(f"{args.family}'s mixture-of-experts arguments need its DecoderSpec: build the model "
                             f"with models.registry.build_model(args)")
        self.args, self.spec = args, spec
        self.compute = compute = compute or ComputeOptions()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.pad_token_id)
        # ModuleDict keeps fully-qualified names stable when blocks are wrapped or dropped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, compute, spec) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, spec.norm_offset)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        inv_freq, self.rope_attention_factor = rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        self.longrope = args.rope_scaling is not None and args.rope_scaling.rope_type == "longrope"
        self.register_buffer("rope_long_inv_freq", self._long_inv_freq(), persistent=False)
        local, self.local_attention_factor = self._local_inv_freq()
        self.register_buffer("rope_local_inv_freq", local, persistent=False)
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

    def _local_inv_freq(self) -> tuple[torch.Tensor | None, float]:
        args = self.args
        if not args.local_rope:
            return None, 1.0
        return rope_frequencies(args.rotary_dim, args.local_rope_theta, args.local_rope_scaling)

    def rope(self, positions: torch.Tensor):
        """cos, sin of ``positions`` ([S] or [B, S], global token indices) as [B or 1, S, 1, Dr/2] fp32; with a
        local RoPE (``args.local_rope``) one pair per layer type: ``{"full_attention": .., "sliding_attention": ..}``"""
        if positions.dim() == 1:
            positions = positions[None]
        inv_freq = self.rope_inv_freq
        if self.longrope:  # transformers: long factors once the sequence passes the original context
            original = self.args.rope_scaling.original_max_position_embeddings
            if self.rope_seq_len:
                inv_freq = self.rope_long_inv_freq if self.rope_seq_len > original else inv_freq
            else:  # like transformers: a traceable choice on the largest position
                inv_freq = torch.where(positions.max() + 1 > original, self.rope_long_inv_freq, inv_freq)
        full = _cos_sin(positions, inv_freq, self.rope_attention_factor)
        if self.rope_local_inv_freq is None:
            return full
        return {"full_attention": full,
                "sliding_attention": _cos_sin(positions, self.rope_local_inv_freq, self.local_attention_factor)}

    def forward(self, tokens, positions=None, attention_mask=None, labels=None, return_stats=False):
        """``tokens: [B, S]`` -> logits ``[B, S, vocab]``, or with ``labels`` the summed cross-entropy;
        with ``return_stats`` a pair ``(that, stats)``: the feed-forward statistics summed over layers (a mixture
        of experts' RouterStats, what its load-balancing loss needs: ``models/moe/aux_loss.py``; None when dense).

        ``positions`` are the global positions of these tokens (default ``arange(S)``);
        under Ulysses each rank passes those of its own slice so RoPE is right everywhere.
        ``attention_mask`` comes from ``ops.attention.build_attention_mask`` (None: causal).
        With ``labels: [B, S]`` the output projection and the loss run together through
        ``compute.loss_backend`` (``ops/loss/registry.py``; the default computes both gradients in
        forward, chunk by chunk), so full logits never exist.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        rope = self.rope(positions)
        h = self.embed(tokens)  # [B, S, D]
        stats = None
        for unit in self.layer_units(self.layers):  # h is each unit's alone: an input held here would stay alive
            h, stats = add_stats(stats, unit(h, rope, attention_mask))
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight  # [V, D]
        out = self.head(h, weight, labels)
        return (out, stats) if return_stats else out

    def head(self, h, weight, labels=None):
        """Logits ``[B, S, vocab]`` of the final hidden states (after the final softcap, if any), or with
        ``labels`` the summed loss from the loss registry's ``compute.loss_backend``."""
        softcap = self.args.final_softcap or None
        if labels is not None:
            return linear_cross_entropy_sum(h, weight, labels, backend=self.compute.loss_backend,
                                            chunk_size=self.compute.loss_chunk_size, softcap=softcap)
        return softcapped(F.linear(h, weight), softcap)  # [B, S, vocab]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # [B, S, D]
        if self.spec.scale_embeddings:  # the scale rounded to h's dtype, as Hugging Face's Gemma
            h = h * torch.tensor(self.args.dim ** 0.5, dtype=h.dtype)
        return h

    def init_buffers(self, buffer_device: torch.device | None = None):
        """(Re)compute the non-persistent RoPE frequencies (garbage after ``to_empty``)."""
        args = self.args
        device = buffer_device or self.rope_inv_freq.device
        self.rope_inv_freq = rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling)[0].to(device)
        if self.longrope:
            self.rope_long_inv_freq = self._long_inv_freq().to(device)
        if args.local_rope:
            self.rope_local_inv_freq = self._local_inv_freq()[0].to(device)

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
