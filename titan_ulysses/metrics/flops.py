"""Model FLOPs per token (attention included, causal counted once) and device peak rates."""

from __future__ import annotations

import torch

from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.registry import num_params

# dense bf16 peak, TFLOP/s
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def flops_per_token(args: DecoderArgs, seq_len: int, lora_params: int = 0) -> float:
    """Training FLOPs (forward + backward = 3x forward) of one token at sequence length ``seq_len``.

    Matmuls: 6 per parameter touched (embedding lookups excluded, the output layer included).
    Attention scores and values: 2 matmuls of ``seq_len x head_dim`` per head and layer,
    forward 4 * S * Dh * H FLOPs per token; causal masking halves it.
    With ``lora_params`` adapter parameters (LoRA) the frozen base computes no weight gradients:
    4 per base parameter (forward and input gradient), 6 per adapter parameter.
    """
    dense_params = num_params(args) - args.vocab_size * args.dim  # drop the embedding lookup
    if args.tie_embeddings:
        dense_params += args.vocab_size * args.dim  # the tied output projection still runs
    attention = 3 * 4 * args.n_layers * args.n_heads * args.head_dim * seq_len / 2
    return (4 if lora_params else 6) * dense_params + 6 * lora_params + attention


def peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of ``device`` in FLOP/s, or None when unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
