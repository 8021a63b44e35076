"""The GPU suite's offload case (``second``): compiled ``full_offload`` against ``full`` with a CUDA memory snapshot.

Issue 44: the compiled 8B/128K full_offload step reserved 68.4 GiB on an H100 where full reserved 59.2, after a
fix that holds them equal under the CPU tracker. This case runs the offload step with ``[profiling]
enable_memory_snapshot`` (a snapshot at its second step), copies the pickle into the suite's output and writes
``benchmarks/memory_snapshot.py``'s summary of the blocks alive at the peak beside it: the window brings back
what the step holds, by allocating frame. It fails when offload's peak (reserved, and allocated where both were
recorded) is not below full's: this run's ``8b_128k_sim8_compile_bf16_full`` row if it ran, else the newest
recorded cell of this GPU (``titan_ulysses/planning/measured.py``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile

from benchmarks.gpu_common import CONFIGS, train
from benchmarks.gpu_perf import SIM8_ONE_STAGE, SYNTHETIC
from benchmarks.memory_snapshot import summarise_file

FULL = "8b_128k_sim8_compile_bf16_full"


def _full_peaks(ctx) -> tuple[float | None, float | None, str]:
    """(reserved GiB, allocated GiB or None, where from) of the compiled full-AC cell on this GPU."""
    for row in ctx.results:
        if row["name"] == FULL and row.get("status") == "measured":
            f = row["figures"]
            return f["peak_gib"], f.get("peak_allocated_gib"), f"this run's {FULL}"
    if not ctx.cuda:
        return None, None, "no GPU"
    import torch

    from titan_ulysses.planning.measured import CELLS

    name = torch.cuda.get_device_name(0)
    cells = [c for c in CELLS if c.name == FULL and c.device in name and c.reserved_gib is not None]
    if not cells:
        return None, None, f"no recorded {FULL} cell of an {name}"
    c = max(cells, key=lambda c: c.date)
    return c.reserved_gib, c.allocated_gib, f"the recorded {FULL} cell ({c.device}, {c.date}, {c.source})"


def offload_vs_full_snapshot(ctx):
    overrides = ["--training.steps", "3", "--activation_checkpoint.mode", "full_offload",
                 "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "-1",
                 "--training.local_batch_size", "1", *SYNTHETIC]
    if ctx.dry_run:  # the plumbing at toy size; a CPU has no allocator to snapshot
        overrides += ["--training.seq_len", "128", "--comm.mode", "fake", "--comm.fake_world_size", "2",
                      "--parallelism.ulysses_degree", "2", "--compile.enable", "false"]
        config = os.path.join(CONFIGS, "debug_model.toml")
    else:
        overrides += [*SIM8_ONE_STAGE, "--training.seq_len", str(128 * 1024), "--compile.enable", "true",
                      "--profiling.enable_memory_snapshot", "true", "--profiling.memory_snapshot_freq", "2"]
        config = os.path.join(CONFIGS, "llama3_8b_128k.toml")
    with tempfile.TemporaryDirectory() as d:
        code, rows, tail = train(ctx, overrides, d, config=config, timeout=400)
        if code or not rows:
            return {"status": "fail", "detail": f"exit {code}: {tail[-300:]}"}
        figures = {"peak_gib": max(r["max_memory_gib"] for r in rows),
                   "peak_allocated_gib": max((r["max_memory_allocated_gib"] for r in rows
                                              if "max_memory_allocated_gib" in r), default=None)}
        snapshots = sorted(glob.glob(os.path.join(d, "**", "rank0_memory_snapshot.pickle"), recursive=True))
        summary = None
        if snapshots:
            kept = os.path.join(ctx.out, "offload_memory_snapshot.pickle")
            shutil.copyfile(snapshots[-1], kept)
            summary = summarise_file(kept, top=20)
            with open(os.path.join(ctx.out, "offload_memory_snapshot_summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
    full_reserved, full_allocated, source = _full_peaks(ctx)
    figures.update(full_peak_gib=full_reserved, full_peak_allocated_gib=full_allocated)
    if summary:
        figures["snapshot_peak_allocated_gib"] = summary["peak_allocated_gib"]
        figures["top_sites"] = "; ".join(f"{s['gib']:.2f} GiB {s['site']}" for s in summary["by_site"][:5])
    detail = (f"compiled full_offload, 3 steps, memory snapshot at step 2 (offload_memory_snapshot.pickle and "
              f"_summary.json in the suite's output); against {source}; passes when offload's peaks are below "
              f"full's")
    if full_reserved is None or not ctx.cuda:
        return {"status": "measured", "figures": figures, "detail": detail}
    below = figures["peak_gib"] < full_reserved and (
        full_allocated is None or figures["peak_allocated_gib"] is None or figures["peak_allocated_gib"] < full_allocated)
    return {"status": "pass" if below else "fail", "figures": figures, "detail": detail}
