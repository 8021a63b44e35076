"""The named model shapes (``model.flavor``): Llama 3 shapes of the decoder, and the byte tokenizer's debug models."""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling

# Byte-level tokenizer: 256 bytes plus BOS, EOS, PAD and one spare id, rounded up to 8.
BYTE_VOCAB_SIZE = 264

FLAVORS: dict[str, DecoderArgs] = {
    "debugmodel": DecoderArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=BYTE_VOCAB_SIZE,
        ffn_hidden_dim=768, rope_theta=10000.0, rope_scaling=None,
    ),
    "debugmodel_gqa1": DecoderArgs(
        dim=256, n_layers=6, n_heads=16, n_kv_heads=1, vocab_size=BYTE_VOCAB_SIZE,
        ffn_hidden_dim=768, rope_theta=10000.0, rope_scaling=None,
    ),
    # Llama 3.2 shapes (tied embeddings, RoPE scaling factor 32)
    "1B": DecoderArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192,
        rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
    ),
    "3B": DecoderArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden_dim=8192,
        rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True,
    ),
    # Llama 3.1 shapes
    "8B": DecoderArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336),
    "70B": DecoderArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672),
}


TRAINED_SEQ_LEN: dict[str, int] = {"debugmodel": 512, "debugmodel_gqa1": 512, "1B": 8192, "3B": 8192, "8B": 8192,
                                   "70B": 8192}
"""The length each flavor is trained at before a context extension: its ``original_max_position_embeddings`` when
``model.rope_scaling_factor`` adds a scaling (the debug models: debug_model.toml's 512, which the guide extends;
Llama 3's 8K, which the 1B-70B shapes' own llama3 scaling already records)."""


def get_flavor(flavor: str, **overrides) -> DecoderArgs:
    if flavor not in FLAVORS:
        raise ValueError(f"model flavor {flavor!r} is not one of {sorted(FLAVORS)}")
    return dataclasses.replace(FLAVORS[flavor], **overrides)
