"""Grouped matrix products for experts: rows sorted by group, one weight matrix per group.

``torch._grouped_mm`` runs all groups in one kernel where the device has it (CUDA sm90+,
bf16, 16-byte aligned rows); elsewhere an exact loop over the groups (never over tokens),
which is also the reference the GPU suite checks the kernel against.
"""

from __future__ import annotations

import torch


def grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands (its CPU path has no backward)."""
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.dtype == w.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and w.shape[-1] % 8 == 0)


def grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Exact reference: ``x`` [T, K] (rows of group g contiguous, in group order), ``w`` [G, K, N],
    ``counts`` [G] rows per group -> [T, N]. One matmul per group (a host sync for the sizes)."""
    parts = torch.split(x, counts.tolist(), dim=0)  # G x [T_g, K]
    return torch.cat([p @ w[g] for g, p in enumerate(parts)], dim=0) if parts else x.new_zeros(0, w.shape[-1])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """``x`` [T, K] sorted by group, ``w`` [G, K, N], ``counts`` [G] -> [T, N].

    ``kernel``: None picks ``torch._grouped_mm`` where :func:`grouped_mm_available`, True forces it,
    False forces the loop."""
    use = grouped_mm_available(x, w) if kernel is None else kernel
    if not use:
        return grouped_mm_loop(x, w, counts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [G], end row of each group
    return torch._grouped_mm(x, w, offs=offsets)  # [T, N]
