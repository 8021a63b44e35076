"""Forward+backward throughput of each local attention backend, against this device's matmul rate.

    python scripts/bench_attention.py                       # CUDA: bf16, S = 8K .. 128K
    python scripts/bench_attention.py --seq-lens 512,1024   # CPU smoke run (fp32)
    python scripts/bench_attention.py --head-dims 64,80,96,128,256 --table   # rows for ops/attention/sdpa_table.py

Causal attention, ``[B, S, H, D]`` with ``--heads``/``--kv-heads`` (GQA) and head_dim 128
by default (``--head-dims``: several; the families' are 64, 80, 96, 128 and 256): Llama-3-8B's heads after Ulysses at sp=8 would be 4 q heads and 1 kv head,
one rank's share. FLOPs counted: forward 2 matmuls of ``2*S*S*D`` per head, halved for
causality, backward 2.5x forward, so ``fwd+bwd = 3.5 * 2 * B * H * S^2 * D``. The
reference rate is a square bf16 (CUDA) or fp32 (CPU) matmul timed in the same run.
Prints one line per (head_dim, backend, seq_len) and the device; ``--json`` writes the same rows;
``--table`` prints, per head_dim, the fastest SDPA kernel over runs of lengths, as rows of
``titan_ulysses/ops/attention/sdpa_table.py`` (what ``model.sdpa_backends = "auto"`` picks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _timer(device: torch.device):
    def run(fn, iters: int, warmup: int) -> float:
        """Median seconds per call of ``fn``."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return run


def matmul_tflops(device, dtype, n: int, timer) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timer(lambda: a @ b, 10, 3) / 1e12


def _sdpa(backend):
    def attend(q, k, v):  # [B, H, S, D]
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    masks = {}

    def attend(q, k, v):
        s = q.shape[2]
        if s not in masks:
            masks[s] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=q.device)
        return compiled(q, k, v, block_mask=masks[s], enable_gqa=q.shape[1] != k.shape[1])

    return attend


def _flash_attn():
    import flash_attn

    def attend(q, k, v):  # flash-attn takes [B, S, H, D]
        out = flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.transpose(1, 2)

    return attend


def backends(device) -> dict:
    found = {}
    if device.type == "cuda":
        found["sdpa_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
        found["sdpa_cudnn"] = _sdpa(SDPBackend.CUDNN_ATTENTION)
        found["flex"] = _flex()
        try:
            found["flash_attn"] = _flash_attn()
        except ImportError:
            print("flash_attn: not installed, skipped", file=sys.stderr)
    else:
        found["sdpa_cpu_flash"] = _sdpa(SDPBackend.FLASH_ATTENTION)
        found["sdpa_math"] = _sdpa(SDPBackend.MATH)
    return found


def table_rows(rows: list[dict], device: str, command: str) -> list[str]:
    """``Measured(...)`` lines for ops/attention/sdpa_table.py: per head_dim, each run of consecutive
    lengths with the same fastest SDPA kernel (``sdpa_flash`` -> ``flash``); other backends are not
    SDPA kernels and are left out. The arch is this GPU's."""
    from titan_ulysses.ops.attention.sdpa_table import arch_of

    arch = arch_of(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    lines, date = [], time.strftime("%Y-%m-%d")
    for d in sorted({r["head_dim"] for r in rows}):
        best = {}
        for r in rows:
            if r["head_dim"] == d and r["backend"].startswith("sdpa_"):
                if r["seq_len"] not in best or r["tflops"] > best[r["seq_len"]]["tflops"]:
                    best[r["seq_len"]] = r
        runs: list[list[dict]] = []
        for s in sorted(best):
            if runs and runs[-1][-1]["backend"] == best[s]["backend"]:
                runs[-1].append(best[s])
            else:
                runs.append([best[s]])
        for run in runs:
            kernel = run[0]["backend"].removeprefix("sdpa_")
            figures = ", ".join(f"{r['seq_len'] // 1024}K {100 * r['fraction_of_matmul']:.0f}%" for r in run)
            lines.append(f"    Measured({arch!r}, {d}, {run[0]['seq_len']}, {run[-1]['seq_len']}, {kernel!r}, "
                         f"{kernel + ' fastest SDPA kernel, % of the matmul rate: ' + figures!r}, {device!r}, "
                         f"{date!r}, {command!r}),")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="8192,16384,32768,65536,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4, help="query heads on this rank")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dims", "--head-dim", default="128", help="comma list of head_dim")
    p.add_argument("--table", action="store_true", help="print sdpa_table.py rows of the fastest SDPA kernel")
    p.add_argument("--backends", default="", help="comma-separated subset (default: all found)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default="", help="also write the rows to this file")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    timer = _timer(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    peak = matmul_tflops(device, dtype, 8192 if device.type == "cuda" else 1024, timer)
    print(f"device: {name}, torch {torch.__version__}, dtype {str(dtype)[6:]}; "
          f"measured matmul rate {peak:.1f} TFLOP/s")
    found = backends(device)
    chosen = a.backends.split(",") if a.backends else list(found)
    rows = []
    for d, s, backend in itertools.product([int(x) for x in a.head_dims.split(",")],
                                           [int(x) for x in a.seq_lens.split(",")], chosen):
        if backend not in found:
            raise SystemExit(f"--backends: {backend!r} is not one of {list(found)} on {device.type}")
        q = torch.randn(a.batch, a.heads, s, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(a.batch, a.kv_heads, s, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        grad = torch.randn_like(q)

        def step(attend=found[backend]):
            attend(q, k, v).backward(grad)

        try:
            sec = timer(step, a.iters, a.warmup)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a kernel refusing a shape, or OOM
            print(f"{backend:>14} D={d:>3} S={s:>7}: failed ({str(e).splitlines()[0][:100]})")
            continue
        flops = 3.5 * 2 * a.batch * a.heads * s * s * d
        tflops = flops / sec / 1e12
        rows.append(dict(device=name, backend=backend, head_dim=d, seq_len=s, ms=sec * 1e3, tflops=tflops,
                         fraction_of_matmul=tflops / peak, matmul_tflops=peak))
        print(f"{backend:>14} D={d:>3} S={s:>7}: {sec * 1e3:9.2f} ms fwd+bwd  {tflops:8.3f} TFLOP/s  "
              f"{100 * tflops / peak:5.1f}% of matmul")
        q = k = v = grad = None  # free before the next length allocates
    if a.table:
        print("\n".join(table_rows(rows, name, " ".join(["python scripts/bench_attention.py", *(argv or sys.argv[1:])]))))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
