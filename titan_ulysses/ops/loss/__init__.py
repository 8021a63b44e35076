"""Token-level cross-entropy, summed, so callers choose the normaliser (the global token count).

At long sequence lengths the logits are the largest activation of the step: for Llama-3 (vocab
128256) a 128K-token slice has 64 GiB of fp32 logits. :func:`linear_cross_entropy_sum` runs the output
projection and the loss together through a backend of ``registry.py`` (``model.loss_backend``):
``fused`` (the default) computes both gradients in forward, chunk by chunk (docs/loss.md).
"""

from titan_ulysses.ops.loss.common import (
    IGNORE_INDEX,
    auto_chunk_size,
    cross_entropy_sum,
    softcapped,
    upcast,
    upcast_dtype,
)
from titan_ulysses.ops.loss.registry import (
    BACKENDS,
    PROFILE_RANGE,
    check_loss_backend,
    get_loss_backend,
    linear_cross_entropy_sum,
)

__all__ = ["BACKENDS", "IGNORE_INDEX", "PROFILE_RANGE", "auto_chunk_size", "check_loss_backend", "cross_entropy_sum",
           "get_loss_backend", "linear_cross_entropy_sum", "softcapped", "upcast", "upcast_dtype"]
