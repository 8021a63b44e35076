"""GPU suite cases the step-time model needs (``titan_ulysses/planning/timing.py``, issue 44 item 4).

``bench_rates``: the achieved rates ``planning/rates.py`` keeps -- bf16 matmul, each attention kernel fwd+bwd and
forward alone (cuDNN and FlashAttention through SDPA, compiled flex) at head_dim 128 (the 8B's) and 64 (the
1B's), the chunked loss of the 8B's vocabulary, and pinned host copies -- printed as the figures of one row per
device to paste into rates.py, with the device, date and this command. ``profile_8b_stages``: where the time of
the compiled AC-full 8B/128K step goes in one stage and in four (``benchmarks/profile_cell.py`` on both): the
model reads the stages' speed as the attention kernel not recomputed (they keep its outputs); no profile has
checked that yet.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from benchmarks.gpu_common import CONFIGS, tagged_json
from benchmarks.gpu_perf import SIM8_ONE_STAGE, SYNTHETIC


def _timed(fn, cuda: bool, iters: int) -> float:
    fn()  # warm-up (kernel choice, compilation)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _attention(kernel: str, s: int, d: int, dtype, device, backward: bool):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, s, d, device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(1, 1, s, d, device=device, dtype=dtype, requires_grad=backward) for _ in range(2))
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, s, s, device=str(device))
        fn = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
        call = lambda: fn(q, k, v, block_mask=mask, enable_gqa=True)  # noqa: E731
    else:
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[kernel]
        backends = [backend] if device.type == "cuda" else [SDPBackend.MATH]

        def call():
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def run():
        out = call()
        if backward:
            out.backward(torch.ones_like(out))

    return run, 4 * 4 * s * s * d / 2 * (3 if backward else 1)  # causal: half of QK^T and PV, 4 heads


def bench_rates(ctx):
    cuda, device = ctx.cuda, ctx.device
    dtype = torch.bfloat16 if cuda else torch.float32
    n, iters = (8192, 10) if cuda else (128, 1)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mm = 2 * n**3 / _timed(lambda: a @ b, cuda, iters) / 1e12
    figures, skipped = {"matmul_tflops": mm}, []
    shapes = [(32768, 128), (131072, 128), (16384, 64)] if cuda else [(64, 16)]
    for kernel in ("cudnn", "flash", "flex"):
        for s, d in shapes:
            for backward in (True, False):
                try:
                    run, flops = _attention(kernel, s, d, dtype, device, backward)
                    rate = flops / _timed(run, cuda, 3 if cuda else 1) / 1e12
                except (RuntimeError, ImportError) as e:  # a kernel this GPU or build lacks
                    skipped.append(f"{kernel}@{s}/hd{d}: {str(e).splitlines()[0][:60]}")
                    break
                figures[f"{kernel}_{'fwdbwd' if backward else 'fwd'}_{s // 1024}K_hd{d}_frac"] = rate / mm
    # the loss's work: the output projection and cross-entropy in fp32, 8192 rows at a time (as the step chunks it)
    t, v, dim = (16384, 128256, 4096) if cuda else (64, 256, 32)
    h = torch.randn(t, dim, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(v, dim, device=device, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (t,), device=device)

    def loss():
        total = sum(torch.nn.functional.cross_entropy((h[i:i + 8192] @ w.T).float(), labels[i:i + 8192],
                                                      reduction="sum") for i in range(0, t, 8192))
        total.backward()

    figures["loss_tflops"] = 6 * t * v * dim / _timed(loss, cuda, 3 if cuda else 1) / 1e12
    host = torch.empty(2**28 if cuda else 2**16, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty_like(host, device=device)
    figures["h2d_gbs"] = host.numel() / _timed(lambda: dev.copy_(host, non_blocking=True), cuda, 5) / 1e9
    figures["d2h_gbs"] = host.numel() / _timed(lambda: host.copy_(dev, non_blocking=True), cuda, 5) / 1e9
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    with open(os.path.join(ctx.out, "bench_rates.json"), "w") as f:
        json.dump({"device": name, "date": time.strftime("%Y-%m-%d"), "command": "python scripts/gpu_suite.py "
                   "--part rest --only bench_rates", "figures": figures, "skipped": skipped}, f, indent=1)
    return {"status": "measured", "figures": figures,
            "detail": f"{name}: the rates for titan_ulysses/planning/rates.py (bench_rates.json in the output); "
                      f"attention fractions of the matmul rate, [1, S, 4/1 heads, hd] causal"
                      + (f"; not run: {'; '.join(skipped)}" if skipped else "")}


def profile_8b_stages(ctx):
    """The compiled AC-full 8B/128K step on a simulated rank of sp=8, one stage against four, profiled."""
    out = {}
    for stages in (1,) if ctx.dry_run else (1, 4):  # a dry run: the plumbing once, at toy size
        if ctx.dry_run:
            argv = ["--config", os.path.join(CONFIGS, "debug_model.toml"), "--training.seq_len", "128",
                    "--compile.enable", "false", "--comm.mode", "fake", "--comm.fake_world_size", "2",
                    "--parallelism.ulysses_degree", "2", "--parallelism.ulysses_head_stages", "1"]
        else:
            argv = ["--config", os.path.join(CONFIGS, "llama3_8b_128k.toml"), *SIM8_ONE_STAGE,
                    "--parallelism.ulysses_head_stages", str(stages), "--training.seq_len", str(128 * 1024),
                    "--compile.enable", "true"]
        argv += [*SYNTHETIC, "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16",
                 "--training.global_batch_size", "-1", "--training.local_batch_size", "1", "--training.steps", "100",
                 "--metrics.log_freq", "10"]
        with tempfile.TemporaryDirectory() as d:
            trace = os.path.join(ctx.out, f"profile_8b_stages{stages}_trace.json.gz") if ctx.cuda else ""
            spec = {"argv": [*argv, "--job.dump_folder", d], "warmup": 1, "steps": 1, "trace": trace}
            summary, why = tagged_json([sys.executable, "-m", "benchmarks.profile_cell", json.dumps(spec)], "PROFILE",
                                       ctx.timeout(150))
        if summary is None:
            return {"status": "fail", "detail": f"stages {stages}: {why[-300:]}"}
        out[stages] = summary
    figures = {f"stages{g}_{p}_pct": round(v, 1) for g, s in out.items() for p, v in s["parts_pct"].items()}
    figures.update({f"stages{g}_wall_ms": s.get("wall_ms") for g, s in out.items()})
    return {"status": "measured", "figures": figures, "profile": {str(g): s for g, s in out.items()},
            "detail": "one steady step each, compiled AC full, 1 and 4 head stages; parts by kernel name and range "
                      "(traces in the output): does the 4-stage step skip the attention kernel's recompute?"}
