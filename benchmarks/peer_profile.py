"""The ``first`` part's view of where the step stands: against its peer, and where its time goes.

* ``peer_1b_16k``: our compiled bf16 step of the 1B shape at 16K tokens on one GPU (passkey rows,
  byte tokenizer, sdpa, no sequence parallelism: ``train_cell``) against the transformers loop a
  user would write (``benchmarks/peer_transformers.py``), same shape, same call. Each side's
  best AC that fits (none first, then ours' selective, then full) and full against full; a third
  column, the same loop with Liger-Kernel's Llama patch (``--liger``: fused linear cross-entropy,
  RMSNorm, SwiGLU, RoPE). Both ratios are taken against the better peer of the two (issue 40's and
  47's targets: 1.2x best against best, 1.0x full against full); a Liger column that cannot run
  (no CUDA, not installed) says so and the ratios are against transformers alone.
* ``profile_1b_16k``: the same cell of ours under ``torch.profiler`` for two steady steps
  (``benchmarks/profile_cell.py`` in its own process): top kernels, GPU idle share, host syncs
  and time by part of the step (``benchmarks/profile_summary.py``).

Dry run (CPU): the debug model at 128 tokens, one AC mode a side, eager, in-process peer.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from benchmarks.gpu_common import CONFIGS, tagged_json
from benchmarks.gpu_perf import SYNTHETIC, train_cell

K = 1024
CONFIG_1B = os.path.join(CONFIGS, "llama3_1b_long.toml")
OURS_1B = [*SYNTHETIC, "--parallelism.ulysses_degree", "1"]  # the cell's own settings, beside train_cell's
SEQ = 16 * K


def _peer(ctx, ac: str, liger: bool = False) -> dict:
    """One peer run: in this process on a dry run, else in its own (memory and compile caches stay there)."""
    from benchmarks.peer_transformers import liger_problem, run_peer

    if liger and liger_problem(ctx.device):
        return {"unavailable": liger_problem(ctx.device)}
    if ctx.dry_run:
        return run_peer(["--config", os.path.join(CONFIGS, "debug_model.toml")], 128, ac, False, 3, 1, ctx.device,
                        liger=liger)
    argv = [sys.executable, "-m", "benchmarks.peer_transformers", "--config", CONFIG_1B, "--seq-len", str(SEQ),
            "--ac", ac, "--compile", "on", "--steps", "6", "--warmup", "2", "--extra", "--model.tokenizer byte",
            *(["--liger"] if liger else [])]
    out, why = tagged_json(argv, "PEER", ctx.timeout(150))
    if out is not None:
        return out
    return {"oom": True} if "out of memory" in why[-400:].lower() else {"error": why[-400:]}


def _ours(ctx, ac: str) -> dict:
    row = train_cell(CONFIG_1B, True, "bf16", ac, OURS_1B, SEQ, steps=(6, 2))(ctx)
    if row["status"] != "measured" or "figures" not in row:
        return {"oom": "OOM" in row.get("detail", ""), "error": None if "OOM" in row.get("detail", "") else row["detail"]}
    f = row["figures"]
    return {"oom": False, "tok_s": f["tok_s_per_dev"], "mfu_pct": f["mfu_pct"], "peak_gib": f["peak_gib"]}


def _best(run, modes) -> tuple[str | None, dict]:
    """The first of ``modes`` that fits (fastest first), and its figures."""
    for ac in modes:
        r = run(ac)
        if r.get("error"):
            raise RuntimeError(f"{ac}: {r['error']}")
        if not r.get("oom"):
            return ac, r
    return None, {}


def peer_1b_16k(ctx):
    ours_modes, peer_modes = (["full"], ["full"]) if ctx.dry_run else (["none", "full"], ["none", "full"])
    ours_full, peer_full = _ours(ctx, "full"), _peer(ctx, "full")
    liger_full = _peer(ctx, "full", liger=True)
    for side, r in (("ours", ours_full), ("peer", peer_full), ("liger", liger_full)):
        if r.get("error"):
            return {"status": "fail", "detail": f"{side}, AC full: {r['error']}"}
    ours_ac, ours = _best(lambda ac: ours_full if ac == "full" else _ours(ctx, ac), ours_modes)
    peer_ac, peer = _best(lambda ac: peer_full if ac == "full" else _peer(ctx, ac), peer_modes)
    liger_ac, liger = (None, {}) if liger_full.get("unavailable") else \
        _best(lambda ac: liger_full if ac == "full" else _peer(ctx, ac, liger=True), peer_modes)
    figures = {"ours_full_tok_s": ours_full.get("tok_s"), "peer_full_tok_s": peer_full.get("tok_s"),
               "liger_full_tok_s": liger_full.get("tok_s"),
               "ours_best_ac": ours_ac, "ours_best_tok_s": ours.get("tok_s"), "ours_best_mfu_pct": ours.get("mfu_pct"),
               "ours_best_peak_gib": ours.get("peak_gib"), "peer_best_ac": peer_ac, "peer_best_tok_s": peer.get("tok_s"),
               "peer_best_peak_gib": peer.get("peak_gib"), "liger_best_ac": liger_ac,
               "liger_best_tok_s": liger.get("tok_s"), "liger_best_peak_gib": liger.get("peak_gib")}
    better_best = max((r.get("tok_s") or 0 for r in (peer, liger)), default=0)
    better_full = max(peer_full.get("tok_s") or 0, liger_full.get("tok_s") or 0)
    if ours.get("tok_s") and better_best:
        figures["best_vs_best"] = ours["tok_s"] / better_best  # against the better peer
    if ours_full.get("tok_s") and better_full:
        figures["full_vs_full"] = ours_full["tok_s"] / better_full
    if ctx.dry_run and not peer_full["losses"][-1] < peer_full["losses"][0]:
        return {"status": "fail", "figures": figures, "detail": f"the peer did not train: losses {peer_full['losses']}"}
    why_no_liger = f" ({liger_full['unavailable']})" if liger_full.get("unavailable") else ""
    return {"status": "measured", "figures": figures,
            "detail": f"1B shape at {128 if ctx.dry_run else SEQ} tokens, one GPU, compiled bf16; ours: train.py "
                      f"(passkey, byte tokenizer, sdpa), the peer: transformers LlamaForCausalLM, fp32 weights under "
                      f"bf16 autocast, SDPA, per-layer compile, fused AdamW; liger: the same after "
                      f"apply_liger_kernel_to_llama{why_no_liger}; "
                      f"medians after warm-up; ratios against the better peer; targets: "
                      f"best_vs_best >= 1.2, full_vs_full >= 1.0"}


def profile_1b_16k(ctx):
    if ctx.dry_run:
        argv = ["--config", os.path.join(CONFIGS, "debug_model.toml"), "--training.seq_len", "128",
                "--compile.enable", "false"]
    else:
        argv = ["--config", CONFIG_1B, "--training.seq_len", str(SEQ), "--compile.enable", "true"]
    argv += [*OURS_1B, "--activation_checkpoint.mode", "none" if ctx.cuda else "full",
             "--training.mixed_precision_param", "bfloat16", "--training.global_batch_size", "-1",
             "--training.local_batch_size", "1", "--training.steps", "100", "--metrics.log_freq", "10"]
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(ctx.out, "profile_1b_16k_trace.json.gz") if ctx.cuda else ""
        spec = {"argv": [*argv, "--job.dump_folder", d], "warmup": 1 if ctx.dry_run else 3, "steps": 2,
                "trace": trace}
        summary, why = tagged_json([sys.executable, "-m", "benchmarks.profile_cell", json.dumps(spec)], "PROFILE",
                                   ctx.timeout(200))
    if summary is None:
        print(why, file=sys.stderr, flush=True)
        return {"status": "fail", "detail": why[-300:]}
    figures = {k: summary.get(k) for k in ("idle_between_kernels_pct", "idle_of_wall_pct", "wall_ms",
                                           "host_syncs", "scalar_reads", "sync_debug_warnings", "peak_gib")}
    figures.update({f"{p}_pct": round(v, 1) for p, v in summary["parts_pct"].items()})
    return {"status": "measured", "figures": figures, "profile": summary,
            "detail": f"two steady steps of ours (AC {'none' if ctx.cuda else 'full'}); parts by kernel name "
                      f"and profiler range; top kernel: {summary['top'][0]['name'][:80]} "
                      f"({summary['top'][0]['pct']:.0f}%); target: GPU idle < 5%"}
