"""The GPU cells measured so far, kept with device, date, command and the doc row they come from.

One row is one training step measured by the GPU suite (``scripts/gpu_suite.py``) or a script that prints
what it measured: the layout and switches it ran, tokens/s per device, MFU and its memory peak. The step-time
model (``timing.py``) is checked against every row (``scripts/check_timing.py``); the memory planner takes
from them what compile and the allocator add over its estimate (``device_fit.py``). The peaks recorded so
far are ``torch.cuda.max_memory_reserved`` (the allocator's reserve included); ``allocated_gib`` is None
where the run did not record ``max_memory_allocated`` (every row before 2026-11-28's suite change).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    name: str
    device: str  # "H100" (80 GB) or "H200" (141 GB)
    date: str
    source: str  # the doc (and row) it is copied from
    flavor: str  # models/flavors.py
    seq_len: int
    sp: int  # ranks per sequence (a simulated rank of sp=8: comm.mode fake, no data moved)
    ac_mode: str
    compiled: bool
    tok_s: float  # per device, median of the timed steps
    mfu_pct: float | None
    reserved_gib: float | None
    head_stages: int = 1
    mlp_tile_size: int = 0
    loss_chunk_size: int = 8192
    precision: str = "bf16"  # or "float8" (tensorwise)
    attention: str = "cudnn"  # the SDPA kernel that ran first: "cudnn" ("auto" on Hopper) or "flash"
    simulated: bool = True  # fake process group: the step moves no data (no all-to-all, no FSDP traffic)
    allocated_gib: float | None = None
    command: str = ""


_SIM8 = ("python scripts/gpu_suite.py --part {part} --only {case}  (train.py --config "
         "train_configs/{config}.toml --comm.mode fake --comm.fake_world_size 8 --parallelism.ulysses_degree 8 "
         "--training.global_batch_size -1 --training.local_batch_size 1 --training.dataset passkey "
         "--model.tokenizer byte --model.attn_backend sdpa ...)")
_H200 = "docs/gpu_runs/2026-11-26-h200.md"
_PEER = "docs/bench_peer.md, the H100 table of 2026-11-27"
_ONE_GPU = ("python scripts/bench_train.py --config train_configs/llama3_1b_long.toml --seq-len {n} --compile on "
            "--precision bf16 --ac {ac} --extra \"--training.dataset passkey --model.tokenizer byte "
            "--model.attn_backend sdpa --parallelism.ulysses_degree 1\"")


def _sim8(part: str, case: str) -> str:
    return _SIM8.format(part=part, case=case, config="llama3_8b_128k")


CELLS: tuple[Cell, ...] = (
    # H200, 2026-11-26 (torch 2.11, cuDNN first)
    Cell("8b_128k_sim8_compile_bf16_selective", "H200", "2026-11-26", f"{_H200}, part first (headline)", "8B",
         131072, 8, "selective", True, 3655, 54.73, 86.82,
         command=_sim8("first", "headline_8b_128k_sim8_compile_bf16_selective")),
    Cell("8b_128k_sim8_compile_float8_selective", "H200", "2026-11-26", f"{_H200}, part second", "8B", 131072, 8,
         "selective", True, 3945, 59.08, 89.16, precision="float8",
         command=_sim8("second", "8b_128k_sim8_compile_float8_selective")),
    Cell("8b_128k_sim8_eager_bf16_full", "H200", "2026-11-26", f"{_H200}, part second", "8B", 131072, 8, "full",
         False, 2748, 41.15, 36.54, command=_sim8("rest", "8b_128k_sim8_eager_bf16_full")),
    Cell("8b_128k_sim8_eager_bf16_full_offload", "H200", "2026-11-26", f"{_H200}, part second", "8B", 131072, 8,
         "full_offload", False, 2715, 40.66, 33.67, command=_sim8("rest", "8b_128k_sim8_eager_bf16_full_offload")),
    Cell("8b_128k_sim8_compile_bf16_full", "H200", "2026-11-26", f"{_H200}, part bench", "8B", 131072, 8, "full",
         True, 2993, 44.83, 59.22, command=_sim8("rest", "8b_128k_sim8_compile_bf16_full")),
    Cell("8b_128k_sim8_compile_bf16_full_stages4", "H200", "2026-11-26", f"{_H200}, part first (call 5)", "8B",
         131072, 8, "full", True, 3363, 50.37, 48.15, head_stages=4,
         command=_sim8("rest", "8b_128k_sim8_compile_bf16_full_stages4")),
    # H200, 2026-11-23: SDPA in PyTorch's order (FlashAttention first)
    Cell("8b_128k_sim8_compile_bf16_selective (flash)", "H200", "2026-11-23",
         "docs/bench_gpu_2026-11-23.md, targets table", "8B", 131072, 8, "selective", True, 3673, 55.0, 91.2,
         attention="flash", command="python scripts/gpu_suite.py --part bench (8b_128k_sim8_compile_bf16_selective)"),
    Cell("8b_128k_sim8_compile_bf16_full (flash)", "H200", "2026-11-23",
         "docs/bench_gpu_2026-11-23.md, targets table", "8B", 131072, 8, "full", True, 2998, 44.9, 63.1,
         attention="flash", command="python scripts/gpu_suite.py --part bench (8b_128k_sim8_compile_bf16_full)"),
    # H100 80 GB
    Cell("8b_128k_sim8_compile_bf16_full", "H100", "2026-11-27", "docs/benchmarks.md, MFU target row", "8B",
         131072, 8, "full", True, 2982, 44.7, 59.2, command=_sim8("rest", "8b_128k_sim8_compile_bf16_full")),
    Cell("8b_128k_sim8_compile_bf16_full_offload", "H100", "2026-11-27",
         "docs/benchmarks.md, full_offload row (before issue 39's hook fix)", "8B", 131072, 8, "full_offload", True,
         2842, None, 75.6, command=_sim8("second", "8b_128k_sim8_compile_bf16_full_offload")),
    Cell("8b_128k_sim8_compile_bf16_full_stages4", "H100", "2026-11-28", "issue 44's table (rest)", "8B", 131072,
         8, "full", True, 3334, 49.9, 48.1, head_stages=4,
         command=_sim8("rest", "8b_128k_sim8_compile_bf16_full_stages4")),
    Cell("8b_128k_sim8_compile_bf16_full_offload", "H100", "2026-11-28", "issue 44's table (second)", "8B",
         131072, 8, "full_offload", True, 2652, 39.7, 68.4,
         command=_sim8("second", "8b_128k_sim8_compile_bf16_full_offload")),
    Cell("1b_16k_compile_bf16_full", "H100", "2026-11-27", _PEER, "1B", 16384, 1, "full", True, 24419, 26.3, 34.6,
         loss_chunk_size=0, simulated=False, command=_ONE_GPU.format(n=16384, ac="full")),
    Cell("1b_16k_compile_bf16_selective", "H100", "2026-11-27", _PEER, "1B", 16384, 1, "selective", True, 27340,
         29.4, 43.6, loss_chunk_size=0, simulated=False, command=_ONE_GPU.format(n=16384, ac="selective")),
    Cell("1b_16k_compile_bf16_none", "H100", "2026-11-27", _PEER, "1B", 16384, 1, "none", True, 27534, 29.6, 49.4,
         loss_chunk_size=0, simulated=False, command=_ONE_GPU.format(n=16384, ac="none")),
    Cell("1b_32k_compile_bf16_full", "H100", "2026-11-27", _PEER, "1B", 32768, 1, "full", True, 19537, 27.4, 38.3,
         loss_chunk_size=0, simulated=False, command=_ONE_GPU.format(n=32768, ac="full")),
)
"""Every recorded GPU training-step cell (the 2026-11-28 H100 selective cell ran out of memory: no figure)."""


def cells(device: str | None = None) -> list[Cell]:
    return [c for c in CELLS if device is None or c.device == device]
