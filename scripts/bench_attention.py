"""Forward+backward throughput of each local attention backend, against this device's matmul rate.

    python scripts/bench_attention.py                       # CUDA: bf16, S = 8K .. 128K
    python scripts/bench_attention.py --seq-lens 512,1024   # CPU smoke run (fp32)

Causal attention, ``[B, S, H, D]`` with ``--heads``/``--kv-heads`` (GQA) and head_dim 128
by default: Llama-3-8B's heads after Ulysses at sp=8 would be 4 q heads and 1 kv head,
one rank's share. FLOPs counted: forward 2 matmuls of ``2*S*S*D`` per head, halved for
causality, backward 2.5x forward, so ``fwd+bwd = 3.5 * 2 * B * H * S^2 * D``. The
reference rate is a square bf16 (CUDA) or fp32 (CPU) matmul timed in the same run.
Prints one line per (backend, seq_len) and the device; ``--json`` writes the same rows.
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="8192,16384,32768,65536,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4, help="query heads on this rank")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
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
    for s in (int(x) for x in a.seq_lens.split(",")):
        for backend in chosen:
            if backend not in found:
                raise SystemExit(f"--backends: {backend!r} is not one of {list(found)} on {device.type}")
            q = torch.randn(a.batch, a.heads, s, a.head_dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(a.batch, a.kv_heads, s, a.head_dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)
            grad = torch.randn_like(q)

            def step(attend=found[backend]):
                attend(q, k, v).backward(grad)

            try:
                sec = timer(step, a.iters, a.warmup)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # a kernel refusing a shape, or OOM
                print(f"{backend:>14} S={s:>7}: failed ({str(e).splitlines()[0][:100]})")
                continue
            flops = 3.5 * 2 * a.batch * a.heads * s * s * a.head_dim
            tflops = flops / sec / 1e12
            rows.append(dict(device=name, backend=backend, seq_len=s, ms=sec * 1e3, tflops=tflops,
                             fraction_of_matmul=tflops / peak, matmul_tflops=peak))
            print(f"{backend:>14} S={s:>7}: {sec * 1e3:9.2f} ms fwd+bwd  {tflops:8.3f} TFLOP/s  "
                  f"{100 * tflops / peak:5.1f}% of matmul")
            q = k = v = grad = None  # free before the next length allocates
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
