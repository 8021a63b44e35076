"""The ``perf`` part: A/B cells for what the profile points to, in one call of at most 300 s.

    python scripts/gpu_suite.py --part perf --out DIR

On the 1B shape at 16K tokens, one GPU, compiled bf16, AC none (``peer_1b_16k``'s cell):

* ``perf_1b_16k_default``: the step as shipped, the base of the next three, same call;
* ``perf_prefetch_off``: ``--training.prefetch_batches 0`` (synchronous loader) against it;
* ``perf_sync_free_off``: ``--training.sync_free_step false`` (the host read every step);
* ``perf_loss_materialized``: ``--model.loss_backend materialized`` (all logits at once) against the default
  fused loss; ``perf_loss_chunked``: ``--model.loss_backend chunked`` (the default until issue 47);
* ``perf_sdpa_order_hd64``: the SDPA kernels at the 1B's heads (32 q / 8 kv, head_dim 64) at 16K,
  which ``"auto"`` has no measurement for (``ops/attention/sdpa_table.py``): the fastest wins a row;
* ``perf_fsdp_one_rank``: FSDP2 on one rank against the plain module (``benchmarks/fsdp_one_rank.py``);
* ``perf_liger``: Liger-Kernel's fused linear cross-entropy, RMSNorm and SwiGLU against ours on
  the 1B's layer shapes at 16K tokens, fwd+bwd, with their numbers against ours. Each side runs on
  its own fresh clones of the inputs: Liger's backward overwrites its saved inputs in place, which
  made a shared-leaf comparison report ``swiglu_rel_err 0.98``. The loss backends side by side are
  ``perf_loss`` (``benchmarks/perf_loss.py``, in ``first``).

A dry run (CPU, CI) builds each train.py cell's command line and does not run it (two of the
settings are being added beside this part; the lead checks them after the merge), and runs the
standalone cells at toy size (Liger needs CUDA: ours alone).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.gpu_common import ROOT, Case
from benchmarks.peer_profile import CONFIG_1B, OURS_1B, SEQ
from benchmarks.gpu_perf import train_cell

AB = {  # cell -> the overrides it adds to the default cell
    "perf_1b_16k_default": [],
    "perf_prefetch_off": ["--training.prefetch_batches", "0"],
    "perf_sync_free_off": ["--training.sync_free_step", "false"],
    "perf_loss_materialized": ["--model.loss_backend", "materialized"],
    "perf_loss_chunked": ["--model.loss_backend", "chunked", "--model.loss_chunk_size", "8192"],
}


def cell_command(name: str) -> list[str]:
    """train.py's overrides for an A/B cell (beside train_cell's own: steps, AC, precision, seq_len, compile)."""
    return [*OURS_1B, *AB[name]]


def _ab(name: str):
    def run(ctx):
        overrides = cell_command(name)
        if ctx.dry_run:
            return {"status": "measured", "figures": {"overrides": " ".join(overrides)},
                    "detail": "dry run: the command is built, not run (train.py --config train_configs/llama3_1b_long.toml "
                              f"--training.seq_len {SEQ} --compile.enable true --activation_checkpoint.mode none ...)"}
        row = train_cell(CONFIG_1B, True, "bf16", "none", overrides, SEQ, steps=(6, 2))(ctx)
        base = next((r for r in ctx.results if r["name"] == "perf_1b_16k_default" and "figures" in r), None)
        if name != "perf_1b_16k_default" and base and "figures" in row:
            row["figures"]["over_default"] = row["figures"]["tok_s_per_dev"] / base["figures"]["tok_s_per_dev"]
        row["detail"] = f"{' '.join(AB[name]) or 'defaults'}; " + row.get("detail", "")
        return row

    return run


def sdpa_order_hd64(ctx):
    import bench_attention  # scripts/: first on the runner's path

    path = os.path.join(ctx.out, "perf_sdpa_hd64.json")
    argv = (["--seq-lens", "128", "--head-dims", "16", "--heads", "4", "--kv-heads", "2", "--iters", "1",
             "--warmup", "1"] if ctx.dry_run else
            ["--seq-lens", str(SEQ), "--head-dims", "64", "--heads", "32", "--kv-heads", "8", "--iters", "5",
             "--warmup", "2", "--backends", "sdpa_cudnn,sdpa_flash", "--table"])
    bench_attention.main([*argv, "--json", path])
    with open(path) as f:
        rows = json.load(f)
    if not rows:
        return {"status": "fail", "detail": "no kernel produced a figure"}
    best = max(rows, key=lambda r: r["tflops"])
    return {"status": "measured", "figures": {r["backend"]: round(r["ms"], 2) for r in rows} | {"fastest": best["backend"]},
            "detail": "ms per causal fwd+bwd at the 1B's heads on one GPU; the fastest is a row for "
                      "ops/attention/sdpa_table.py (printed in the log)"}


def fsdp_one_rank(ctx):
    spec = ({"flavor": "debugmodel", "n_layers": 2, "seq_len": 64, "steps": 3, "warmup": 1} if ctx.dry_run else
            {"flavor": "1B", "n_layers": 4, "seq_len": SEQ, "steps": 6, "warmup": 2})
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fsdp_one_rank", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, timeout=ctx.timeout(90))
    for line in proc.stdout.splitlines():
        if line.startswith("FSDP1 "):
            r = json.loads(line[6:])
            return {"status": "measured",
                    "figures": {"fsdp_tok_s": r["fsdp"]["tok_s"], "plain_tok_s": r["plain"]["tok_s"],
                                "fsdp_over_plain": r["fsdp_over_plain"], "fsdp_peak_gib": r["fsdp"]["peak_gib"],
                                "plain_peak_gib": r["plain"]["peak_gib"]},
                    "detail": f"{spec['flavor']} cut to {spec['n_layers']} layers, {spec['seq_len']} tokens, eager; "
                              "FSDP2 bf16 params vs fp32 module under bf16 autocast; medians"}
    return {"status": "fail", "detail": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}"}


def _time(fn, cuda: bool, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def liger_vs_ours(ctx):
    """fwd+bwd ms of each op, ours and Liger's, and Liger's largest relative error against ours."""
    import torch.nn.functional as F

    from benchmarks.gpu_common import rel_err
    from titan_ulysses.ops.loss import linear_cross_entropy_sum
    from titan_ulysses.ops.norm import rms_norm

    try:
        from liger_kernel.transformers import functional as liger
    except ImportError:
        liger = None
    if liger is None and ctx.cuda:
        return {"status": "skipped", "detail": "liger-kernel is not installed (carry it: scripts/gpu_wheels.sh)"}
    t, d, f, v = (64, 16, 32, 48) if ctx.dry_run else (SEQ, 2048, 8192, 128256)  # the 1B's shapes
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    gen = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(ctx.device, dtype).requires_grad_()

    labels = torch.randint(0, v, (t,), generator=gen).to(ctx.device)
    inputs = {"loss": (make(t, d), make(v, d, scale=d ** -0.5)), "rmsnorm": (make(t, d), make(d)),
              "swiglu": (make(t, f), make(t, f))}
    ops = {  # (ours, theirs) of the op's leaves
        "loss": (lambda h, w: linear_cross_entropy_sum(h, w, labels),
                 lambda h, w: liger.liger_fused_linear_cross_entropy(h, w, labels, reduction="sum")),
        "rmsnorm": (lambda x, w: rms_norm(x, w, 1e-5), lambda x, w: liger.liger_rms_norm(x, w, 1e-5, in_place=False)),
        "swiglu": (lambda a, b: F.silu(a) * b, lambda a, b: liger.liger_swiglu(a, b)),
    }
    figures = {}
    for op, (ours, theirs) in ops.items():
        results = {}
        for who, op_fn in (("ours", ours), ("liger", theirs)):
            if who == "liger" and liger is None:
                continue
            # fresh leaves for each side: Liger's backward overwrites what it saved (its inputs) in place
            leaves = [x.detach().clone().requires_grad_() for x in inputs[op]]

            def fn(op_fn=op_fn, leaves=leaves):
                return op_fn(*leaves)

            def step(fn=fn, leaves=leaves):
                for leaf in leaves:
                    leaf.grad = None
                out = fn()
                out.backward(torch.ones_like(out))
                return out

            figures[f"{op}_{who}_ms"] = _time(step, ctx.cuda, 1 if ctx.dry_run else 10)
            out = step()
            results[who] = [out.detach(), *(leaf.grad.detach() for leaf in leaves)]
        if "liger" in results:
            figures[f"{op}_liger_over_ours"] = figures[f"{op}_ours_ms"] / figures[f"{op}_liger_ms"]
            figures[f"{op}_rel_err"] = max(rel_err(x_, y_) for x_, y_ in zip(results["liger"], results["ours"]))
    return {"status": "measured", "figures": figures,
            "detail": f"fwd+bwd, {t} tokens, dim {d}, ffn {f}, vocab {v}, {str(dtype).removeprefix('torch.')}; ours: "
                      "the fused loss (ops/loss, default chunk), ops/norm.rms_norm, silu(a)*b, eager; liger_over_ours > 1: Liger faster"
                      + ("" if liger else "; liger-kernel not installed here (it needs CUDA): ours only")}


PERF_CASES = [
    *[Case(name, _ab(name), 45, 1) for name in AB],
    Case("perf_sdpa_order_hd64", sdpa_order_hd64, 10, 3),
    Case("perf_fsdp_one_rank", fsdp_one_rank, 30, 25),
    Case("perf_liger", liger_vs_ours, 20, 3),
]
