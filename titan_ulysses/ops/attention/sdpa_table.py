"""What ``model.sdpa_backends = "auto"`` puts first for a causal call, by GPU, head_dim and length:
the measurements it stands on, kept beside the choice.

A row is one measurement of ``scripts/bench_attention.py`` (causal fwd+bwd, bf16, ``--heads 4
--kv-heads 1``): on which GPU generation, at which head_dim and lengths the named kernel was the
fastest SDPA kernel, the figures, device, date and command. ``python scripts/bench_attention.py
--head-dims 64,80,96,128,256 --table`` prints rows in this form to paste here.

Where no row covers a (GPU, head_dim, length), ``"auto"`` keeps the order it had before the
table (``UNMEASURED``: cuDNN first on Hopper, PyTorch's order elsewhere) and says so
(:func:`auto_causal` returns no row). Not measured as of 2026-11-27: head_dim 64, 80, 96 and 256
on any GPU; head_dim 128 below 32K tokens; any GPU but Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    arch: str  # "hopper": compute capability 9.x
    head_dim: int
    min_len: int  # the measured lengths, inclusive
    max_len: int
    fastest: str  # a name of SDPA_KERNELS
    figures: str
    device: str
    date: str
    command: str


MEASURED: tuple[Measured, ...] = (
    Measured("hopper", 128, 32768, 131072, "cudnn",
             "cuDNN 74% (32K), 70% (64K, 128K) of the bf16 matmul rate measured in the same run (787 TFLOP/s); "
             "FlashAttention through SDPA 39-41%", "NVIDIA H200", "2026-11-23",
             "python scripts/bench_attention.py  (head_dim 128, 4 q / 1 kv heads; docs/bench_gpu_2026-11-23.md)"),
)

# before the table: cuDNN first on Hopper (the 128-dim measurement above, taken for every shape),
# PyTorch's own order on other GPUs (others measured cuDNN slower on Ampere and Blackwell)
UNMEASURED = {"hopper": ("cudnn",)}


def arch_of(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return "cpu"
    return {9: "hopper", 8: "ampere", 10: "blackwell"}.get(capability[0], f"sm_{capability[0]}x")


def measured_row(arch: str, head_dim: int, seq_len: int) -> Measured | None:
    for row in MEASURED:
        if row.arch == arch and row.head_dim == head_dim and row.min_len <= seq_len <= row.max_len:
            return row
    return None


def auto_causal(capability: tuple[int, int] | None, head_dim: int = 0, seq_len: int = 0
                ) -> tuple[tuple[str, ...], Measured | None]:
    """The kernels ``"auto"`` puts first for a causal call (``()``: PyTorch's order), and the row
    it stands on (None: no measurement covers this shape; the order from before the table)."""
    arch = arch_of(capability)
    row = measured_row(arch, head_dim, seq_len) if head_dim and seq_len else None
    if row is not None:
        return (row.fastest,), row
    return UNMEASURED.get(arch, ()), None
