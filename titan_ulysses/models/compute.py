"""How a run computes the model, as opposed to what the model is (``DecoderArgs``).

These settings change memory and speed, never the function the model computes; they are
not part of a checkpoint's ``model_args.json``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ComputeOptions:
    attn_backend: str = "sdpa"
    """Local attention: "sdpa", "flex" or "flash_attn" (see ops/attention.py)."""
    sdpa_backends: str = "auto"
    """With "sdpa": the order its kernels are tried in, as model.sdpa_backends (resolved for the
    machine the model is built on: ops.attention.sdpa_priority)."""
    mlp_tile_size: int = 0
    """Tokens per tile of the tiled MLP (0: untiled). Bounds MLP intermediates to one tile."""
    loss_backend: str = "fused"
    """The output projection + cross-entropy when the model computes the loss: a backend of
    ops/loss/registry.py ("fused", "chunked", "materialized", "liger", "cce")."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the chunking loss backends (0: chosen from vocab, dim and the token count)."""

    @classmethod
    def from_config(cls, model_config) -> "ComputeOptions":
        """From the ``[model]`` section of a JobConfig."""
        m = model_config
        return cls(attn_backend=m.attn_backend, sdpa_backends=m.sdpa_backends, mlp_tile_size=m.mlp_tile_size,
                   loss_backend=m.loss_backend, loss_chunk_size=m.loss_chunk_size)
