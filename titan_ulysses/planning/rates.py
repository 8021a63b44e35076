"""Achieved rates per device for the step-time model (``timing.py``), each kept with where it comes from.

Like ``ops/attention/sdpa_table.py``: a figure is measured by a command on a device on a date, or derived
from measured cells (``measured.py``) and says which. As of 2026-11-28 the matmul and attention rates are
the H200's ``bench_attention`` run of 2026-11-23; the rest is fitted to the 8B/128K cells of 2026-11-26 (H200)
and 2026-11-27/28 (H100), by ``scripts/check_timing.py --fit``, which prints the fit and the command. No
rate has been measured on an H100 by itself: the suite case ``bench_rates`` (``benchmarks/rates.py``) measures
matmul, each attention kernel (fwd+bwd and fwd alone), the loss and host copies on the next GPU window and
prints rows in this form to paste here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceRates:
    device: str
    memory_gib: float
    peak_tflops: float  # dense bf16 peak (metrics/flops.py's), the MFU's denominator
    matmul_tflops: float  # achieved bf16 matmul
    attention_fraction: dict = field(default_factory=dict)  # kernel -> fwd+bwd rate over matmul_tflops
    attention_fwd_fraction: dict = field(default_factory=dict)  # kernel -> forward-only rate over matmul_tflops
    hbm_gbs: float = 0.0  # HBM bandwidth, GB/s (the datasheet's)
    hbm_efficiency: float = 1.0  # the fraction of it the memory-bound ops reach (fitted)
    eager_memory_factor: float = 1.0  # memory-bound time of an eager step over a compiled one (fitted)
    float8_linear_speedup: float = 1.0  # tensorwise float8 linear layers over bf16 (fitted)
    host_exposed_gbs: float = 1.0  # full_offload's host traffic, GB/s of it left on the step's path (fitted)
    link_gbs: float = 450.0  # GB/s per GPU over NVLink (the datasheet's; no multi-rank step measured yet)
    sources: tuple = ()


_BENCH = ("H200, 2026-11-23, python scripts/gpu_suite.py --part bench (bench_attention: causal fwd+bwd bf16, "
          "4 q / 1 kv heads, head_dim 128, 32K-128K; docs/bench_gpu_2026-11-23.md): matmul 787 TFLOP/s, "
          "cuDNN 70% at 64K-128K, FlashAttention 39-41%, compiled flex 38-42%")
_FIT = "python scripts/check_timing.py --fit (2026-11-28, no GPU: fitted to measured.py's cells, named per figure)"

_H200 = DeviceRates(
    device="H200", memory_gib=141.0, peak_tflops=989.0, matmul_tflops=787.0,
    attention_fraction={"cudnn": 0.70, "flash": 0.40, "flex": 0.40},
    attention_fwd_fraction={"cudnn": 1.02, "flash": 0.58, "flex": 0.58},
    hbm_gbs=4800.0, hbm_efficiency=0.175, eager_memory_factor=2.02, float8_linear_speedup=1.61,
    host_exposed_gbs=119.0,
    sources=(f"matmul, attention fwd+bwd: {_BENCH}",
             "attention forward alone: cudnn 1.02 (803 TFLOP/s) fitted to 8b_128k_sim8_compile_bf16_full, H200 2026-11-26; flash 0.58 "
             "and flex 0.58 assumed (the same 1.46x over their fwd+bwd fraction; no training cell is known to have run "
             "either: the suite measures flex's step in bench_rates)",
             "hbm_efficiency 0.175: fitted to 8b_128k_sim8_compile_bf16_selective, H200 2026-11-26",
             "eager_memory_factor 2.02: fitted to 8b_128k_sim8_eager_bf16_full against the compiled cell, H200 2026-11-26",
             "float8_linear_speedup 1.61: fitted to 8b_128k_sim8_compile_float8_selective, H200 2026-11-26",
             "host_exposed_gbs 119: fitted to 8b_128k_sim8_eager_bf16_full_offload against ..._eager_bf16_full, "
             "H200 2026-11-26", f"fits: {_FIT}"),
)

_H100 = DeviceRates(
    device="H100", memory_gib=80.0, peak_tflops=989.0, matmul_tflops=787.0,
    attention_fraction=dict(_H200.attention_fraction), attention_fwd_fraction=dict(_H200.attention_fwd_fraction),
    hbm_gbs=3350.0, hbm_efficiency=0.175 * 4800 / 3350, eager_memory_factor=2.02, float8_linear_speedup=1.61,
    host_exposed_gbs=12.2,
    sources=("matmul, attention, memory-bound time, eager and float8 factors: the H200's (same SMs and clocks; "
             "the memory-bound time taken as the H200's: its HBM is faster, but the H100's compiled AC-full cell "
             "ran within 0.4% of the H200's, 2,982 against 2,993 tok/s), not measured on an H100",
             "host_exposed_gbs 12.2: fitted to 8b_128k_sim8_compile_bf16_full_offload (2,652 tok/s, issue 44's "
             "table, 2026-11-28) against ..._full (2,982, 2026-11-27)", f"fits: {_FIT}"),
)

RATES: dict[str, DeviceRates] = {"H100": _H100, "H200": _H200}


def device_rates(name: str | None = None, memory_gib: float | None = None) -> DeviceRates:
    """The rates of the named device, else of the listed device whose memory is nearest ``memory_gib``."""
    if name:
        key = next((k for k in RATES if k.lower() in name.lower()), None)
        if key is None:
            raise ValueError(f"no achieved rates for device {name!r}: one of {', '.join(RATES)} "
                             f"(titan_ulysses/planning/rates.py)")
        return RATES[key]
    gib = 80.0 if memory_gib is None else memory_gib
    return min(RATES.values(), key=lambda r: abs(r.memory_gib - gib))


KERNELS = {"sdpa": "cudnn", "flex": "flex", "flash_attn": "flash"}
"""``model.attn_backend`` -> the kernel whose rate the model takes (sdpa: cuDNN, which ``"auto"`` puts first on
Hopper; a packed flex step attends less than one document, which the model does not know: an upper bound)."""


def kernel_of(attn_backend: str) -> str:
    return KERNELS.get(attn_backend, "cudnn")
