"""A device tensor's copy in pinned host memory, in pieces the host allocator does not round up.

PyTorch's caching host allocator (``at::CachingHostAllocator``, behind ``pin_memory=True``)
rounds every request up to a power of two: its free lists are indexed by powers of two. A
block input of Llama-3-8B at 6M tokens over sp=8 is 5.75 GiB and would take 8 GiB of pinned
memory, 32 of them 256 GiB where 184 GiB are needed. Unless ``PYTORCH_ALLOC_CONF`` sets
``pinned_max_round_threshold_mb``, which a launch cannot be relied on to do, a copy here is
made of pieces whose sizes are powers of two, the bits of its byte count rounded up to
``floor``: they take exactly their bytes, and at most ``floor`` is wasted per tensor. Freed
pieces go back to the allocator's free lists and serve the next step's copies of the same
size.

A contiguous tensor is copied piece by piece through its bytes (``view(torch.uint8)``); any
other is kept as one buffer (rounded). On CPU (no pinning) the same pieces are plain host
tensors, so the byte arithmetic is tested without a GPU (``tests/test_activation_offload.py``).
"""

from __future__ import annotations

import torch

FLOOR = 2 << 20
"""The smallest piece (bytes): the most a copy wastes."""


def piece_sizes(nbytes: int, floor: int = FLOOR) -> list[int]:
    """Powers of two, largest first, each at least ``floor``, summing to ``nbytes`` rounded up to ``floor``."""
    if floor & (floor - 1) or floor <= 0:
        raise ValueError(f"floor must be a power of two, got {floor}")
    total = -(-nbytes // floor) * floor
    return [1 << bit for bit in range(total.bit_length() - 1, -1, -1) if total >> bit & 1]


class HostCopy:
    """``t`` in host memory (pinned where ``pin``), as pieces of :func:`piece_sizes` or one buffer."""

    def __init__(self, t: torch.Tensor, pin: bool, floor: int = FLOOR):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.whole: torch.Tensor | None = None
        self.pieces: list[torch.Tensor] = []
        t = t.detach()
        if not t.is_contiguous():  # rare for what a block saves; its layout is kept
            self.whole = torch.empty_like(t, device="cpu", pin_memory=pin)
            self.whole.copy_(t, non_blocking=pin)
            return
        flat = t.reshape(-1).view(torch.uint8)  # [nbytes]
        start = 0
        for size in piece_sizes(flat.numel(), floor):
            piece = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            n = min(size, flat.numel() - start)
            if n > 0:
                piece[:n].copy_(flat[start:start + n], non_blocking=pin)
            self.pieces.append(piece)
            start += n

    def restore(self, non_blocking: bool) -> torch.Tensor:
        """A new tensor on the original device with the original contents; the host memory is let go."""
        if self.whole is not None:
            out, self.whole = self.whole.to(self.device, non_blocking=non_blocking), None
            return out
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        flat = out.reshape(-1).view(torch.uint8)
        start = 0
        for piece in self.pieces:
            n = min(piece.numel(), flat.numel() - start)
            if n > 0:
                flat[start:start + n].copy_(piece[:n], non_blocking=non_blocking)
            start += n
        self.pieces = []
        return out
