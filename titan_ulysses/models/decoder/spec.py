"""What a family's decoder does differently from Llama's beyond the numbers of its config.json.

``DecoderArgs`` holds what config.json says (shapes, RoPE, windows, softcaps, layer types)
and is recorded with every checkpoint; a ``DecoderSpec`` is what the family *is* (its norms,
its embedding scale, its feed-forward), declared once in ``models/families/X.py``. Llama's
is the default, so Llama, Qwen, Mistral and Phi-3 declare none.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_ulysses.models.decoder.feed_forward import FeedForwardBuilder, dense


@dataclass(frozen=True)
class DecoderSpec:
    feed_forward: FeedForwardBuilder = dense
    """Builds each block's feed-forward (``feed_forward.py``): the seam a family replaces (mixture of experts)."""
    experts: bool = False
    """The family is a mixture of experts (its feed-forward routes to ``args.moe``'s experts)."""
    norm_offset: float = 0.0
    """Every RMSNorm scales by ``norm_offset + weight`` and its weight starts at ``1 - norm_offset`` (Gemma: 1)."""
    sandwich_norms: bool = False
    """Norms after attention and after the feed-forward too, before each joins the residual (Gemma)."""
    scale_embeddings: bool = False
    """Embeddings multiplied by ``sqrt(dim)``, rounded to their dtype (Gemma)."""
