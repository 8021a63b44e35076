"""The GPU suite: every CUDA path checked and every performance target measured.

    bash scripts/gpu_wheels.sh                      # here, once: wheels the GPU machine lacks -> .whl/
    python scripts/gpu_suite.py --part first --out DIR     # what proves the most: 450 s on an H100
    python scripts/gpu_suite.py --part second --out DIR    # what did not fit: 180 s on a started machine
    python scripts/gpu_suite.py --part perf --out DIR      # A/B cells of the step (benchmarks/perf_ab.py): 300 s
    python scripts/gpu_suite.py --part correctness --out DIR
    python scripts/gpu_suite.py --part bench --out DIR
    python scripts/gpu_suite.py --part limits --out DIR
    python scripts/gpu_suite.py --part all --dry-run --out DIR     # every case at toy size on CPU (CI)

``first``, ``second`` and ``rest`` (``short_parts()`` below) are for GPU windows of 15 minutes;
``first.json`` holds ``planned_s``, the sum of the cases' estimates plus the start-up.
Each part runs its cases in order of importance within ``--budget`` seconds (default: the
part's own, ``BUDGETS``, else 500): a case whose
estimated time no longer fits is skipped and reported as skipped, never silently left
out. After every case the part rewrites ``DIR/<part>.json`` (so a killed run keeps what it
measured) and ``DIR/<part>.md``, a table to paste into docs/benchmarks.md.

A case reports ``pass`` / ``fail`` (a check with a stated tolerance), ``measured`` (a
figure with no pass/fail), ``skipped`` (with the reason) or ``error`` (the exception: a
bug to fix). The correctness cases are tests, in ``tests/gpu/`` (pytest runs them too, under the
``gpu`` marker); the performance and limits cases are in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# after this folder: the repository (as other scripts here add it) and tests/ (as tests/conftest.py
# does for pytest): the correctness cases are the package ``gpu`` (tests/gpu/) beside the helpers they use
sys.path[1:1] = [ROOT, os.path.join(ROOT, "tests")]

from benchmarks.gpu_common import Case, Context, Skip  # noqa: E402


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}), torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, Python {platform.python_version()}")
    return f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, Python {platform.python_version()}"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_cell(x)}" for k, x in v.items())
    return str(v)


def markdown(part: str, header: dict, results: list[dict]) -> str:
    lines = [f"### GPU suite, part `{part}`", "",
             f"Device: {header['device']}. Command: `{header['command']}`. "
             f"Budget {header['budget_s']:.0f} s (planned {header.get('planned_s', 0):.0f} s), "
             f"used {header.get('elapsed_s', 0):.0f} s.", "",
             "| case | status | s | figures | detail |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        figures = _cell(r.get("figures", {})).replace("|", "/")
        detail = str(r.get("detail", "")).replace("|", "/").replace("\n", " ")[:300]
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.0f} | {figures} | {detail} |")
    return "\n".join(lines) + "\n"


def run_part(part: str, cases: list[Case], ctx: Context, header: dict) -> list[dict]:
    start = time.monotonic()

    def write():
        header["elapsed_s"] = time.monotonic() - start
        with open(os.path.join(ctx.out, f"{part}.json"), "w") as f:
            json.dump({**header, "results": ctx.results}, f, indent=1)
        with open(os.path.join(ctx.out, f"{part}.md"), "w") as f:
            f.write(markdown(part, header, ctx.results))

    for case in cases:
        est = case.dry_est_s if ctx.dry_run else case.est_s
        t0 = time.monotonic()
        if ctx.remaining() < est:
            row = {"name": case.name, "status": "skipped",
                   "detail": f"budget: {ctx.remaining():.0f} s left, the case needs about {est:.0f} s"}
        else:
            try:
                row = {"name": case.name, **case.fn(ctx)}
            except Skip as e:
                row = {"name": case.name, "status": "skipped", "detail": str(e)}
            except Exception as e:  # a case's bug must not cost the rest of the part
                tb = traceback.format_exc()
                print(tb, file=sys.stderr, flush=True)
                row = {"name": case.name, "status": "error",
                       "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            finally:
                if ctx.cuda:
                    torch.cuda.empty_cache()
        row["seconds"] = time.monotonic() - t0
        ctx.results.append(row)
        print(f"[{part}] {row['name']}: {row['status']} ({row['seconds']:.0f} s) "
              f"{_cell(row.get('figures', {}))} {row.get('detail', '')}", flush=True)
        write()
    write()
    return ctx.results


OVERHEAD_S = 15  # the wheel install and the suite's own start (imports, CUDA context), before the first case
BUDGETS = {"first": 450.0, "second": 180.0, "rest": 500.0, "perf": 300.0}


def _by_name(*lists) -> dict:
    return {c.name: c for cases in lists for c in cases}


def short_parts() -> dict[str, list[Case]]:
    """What proves the most per second of a 15-minute GPU window. ``first`` (planned within 450 s on
    an H100, wheel install and compile warm-up included): the kernels ``"auto"`` picks, compile
    against eager in one step, the pinned-stager save and resume, packed documents without a dense
    mask, cp's per-chunk kernel, head stages and LoRA on ranks sharing the GPU, every family's bf16
    logits against transformers, a transformers Llama under ``apply_ulysses`` in bf16; then our 1B step at
    16K against the transformers loop (with and without Liger-Kernel) and its profile
    (``benchmarks/peer_profile.py``), the loss backends side by side (``perf_loss``), and the headline 8B
    step in the layout the planner finds fastest on this GPU, with its prediction and memory estimate.
    ``second`` (within 180 s on a started machine): float8 against the first part's cells, ``full_offload``
    against ``full`` with a memory snapshot, the 128K packed-documents row. ``rest``: what fits neither (compile
    against eager and the pinned-stager resume, both passed in earlier windows; the 6M limits point, the head
    stages' cost and their profile, the step-time model's rates among them). ``perf`` (``benchmarks/perf_ab.py``): the A/B cells."""
    from benchmarks import gpu_perf
    from benchmarks.headline import headline_8b, limits_6m_two_layers
    from benchmarks.offload_case import offload_vs_full_snapshot
    from benchmarks.planner_cases import bench_rates, profile_8b_stages
    from benchmarks.peer_profile import peer_1b_16k, profile_1b_16k
    from benchmarks.perf_loss import perf_loss
    from gpu import correctness
    from gpu.models import families_bf16, moe_grouped_mm
    from gpu.multirank import features_multirank

    known = _by_name(correctness.CASES, gpu_perf.BENCH_CASES)
    cell_steps = gpu_perf.cell_steps
    # estimates: the 2026-11-26 H200 run's seconds (docs/gpu_runs/) with a margin for an H100's slower memory
    first = [
        Case("attn_sdpa_priority_auto", known["attn_sdpa_priority_auto"].fn, 12, 2),
        Case("attn_sdpa_docs_window_softcap", known["attn_sdpa_docs_window_softcap"].fn, 5, 3),
        Case("attn_sdpa_lower_right_cp", known["attn_sdpa_lower_right_cp"].fn, 5, 2),
        Case("features_multirank", features_multirank, 30, 40),
        Case("families_bf16", families_bf16, 15, 10),
        known["hf_llama_ulysses_bf16"],  # issue 37: a transformers model under apply_ulysses, bf16 (never on a GPU)
        # where the step stands (issue 40): against the transformers loop, 2-4 compiled 1B runs a
        # side (estimates: about 35 s each, not yet measured), then where its time goes
        Case("peer_1b_16k", peer_1b_16k, 180, 30),  # 6 runs: ours, the peer and the peer with Liger, AC none and full
        Case("profile_1b_16k", profile_1b_16k, 45, 30),
        Case("perf_loss", perf_loss, 40, 5),  # issue 47: every loss backend at two shapes (benchmarks/perf_loss.py)
        Case("headline_8b_128k_sim8_planned", headline_8b, 65, 15),  # the planner's fastest layout that fits
    ]
    second = [  # against the first part's cells on the same started machine
        Case("8b_128k_sim8_compile_float8_selective", cell_steps(True, "float8", "selective"), 65, 10),
        # issue 44: offload's peak against full's, with a CUDA memory snapshot of what it holds
        Case("8b_128k_sim8_compile_bf16_full_offload_snapshot", offload_vs_full_snapshot, 65, 10),
        Case("bench_packed_128k", known["bench_packed_128k"].fn, 35, 5),
    ]
    # moved out of first for the peer and profile cases (2026-11-27): the 6M limits point, flex's
    # packed-documents check and the head stages' cost (the compiled AC-full step, plain and in 4
    # stages; found a per-layer recompile on 2026-11-26)
    # compile against eager and the pinned-stager resume moved here for perf_loss and the Liger peer (2026-11-28):
    # first stays within its 450 s
    rest = [Case("compile_one_step", correctness.compile_one_step_modes(("selective", "full_offload")), 30, 20),
            Case("checkpoint_async_pinned_resume", known["checkpoint_async_pinned_resume"].fn, 45, 30),
            Case("limits_6m_staged_two_layers_1m", limits_6m_two_layers, 55, 15),
            Case("attn_flex_docs_window_softcap", known["attn_flex_docs_window_softcap"].fn, 25, 5),
            Case("8b_128k_sim8_compile_bf16_full", cell_steps(True, "bf16", "full"), 65, 10),
            Case("8b_128k_sim8_compile_bf16_full_stages4",
                 cell_steps(True, "bf16", "full", ["--parallelism.ulysses_head_stages", "4"]), 65, 10),
            known["attn_flex_cp4_docs_window_softcap"], known["attn_flash_attn_cp4_docs_window"],
            Case("moe_grouped_mm_bf16", moe_grouped_mm, 10, 3),
            Case("attn_flash_attn_docs_window_softcap", known["attn_flash_attn_docs_window_softcap"].fn, 5, 1),
            Case("bench_rates", bench_rates, 60, 10),  # the step-time model's rates (planning/rates.py)
            Case("profile_8b_stages", profile_8b_stages, 110, 30),  # why head stages are faster
            known["hf_sft_ulysses_bf16"],  # issue 45: TRL's SFTTrainer under ulysses_trainer, bf16
            known["hf_memory_bf16"],  # issue 45: apply_ulysses' memory options, peak per token (bench_hf_memory.py)
            Case("8b_128k_sim8_eager_bf16_full", cell_steps(False, "bf16", "full"), 45, 10),
            Case("8b_128k_sim8_eager_bf16_full_offload", cell_steps(False, "bf16", "full_offload"), 45, 10)]
    return {"first": first, "second": second, "rest": rest}



def parts() -> dict[str, list[Case]]:
    from benchmarks import gpu_perf, perf_ab
    from gpu import correctness

    return {**short_parts(), "perf": perf_ab.PERF_CASES, "correctness": correctness.CASES,
            "bench": gpu_perf.BENCH_CASES, "limits": gpu_perf.LIMIT_CASES}


def planned_s(part: str, cases: list[Case]) -> float:
    """The part's plan on an H100: its cases' estimates, plus the start-up for the short parts."""
    return sum(c.est_s for c in cases) + (OVERHEAD_S if part in BUDGETS else 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["first", "second", "rest", "perf", "correctness", "bench", "limits", "all"])
    p.add_argument("--out", default="outputs/gpu_suite")
    p.add_argument("--budget", type=float, default=None, help="seconds per part (default: the part's own, else 500)")
    p.add_argument("--dry-run", action="store_true", help="toy sizes on CPU: checks that every case runs")
    p.add_argument("--only", default="", help="comma-separated case names (default: all of the part)")
    p.add_argument("--trial", default="", help=argparse.SUPPRESS)  # internal: one memory trial (see benchmarks/gpu_perf.py)
    a = p.parse_args(argv)
    if a.trial:
        from benchmarks import gpu_perf

        return gpu_perf.trial_main(json.loads(a.trial))
    if not a.part:
        p.error("--part is required")
    only = set(filter(None, a.only.split(",")))

    chosen = ["correctness", "bench", "limits", "perf"] if a.part == "all" else [a.part]
    unknown = sorted(only - {c.name for part in chosen for c in parts()[part]})
    if unknown:  # before any GPU time is spent on a typo
        p.error(f"--only: no case {', '.join(unknown)} in --part {a.part}; its cases: "
                + ", ".join(c.name for part in chosen for c in parts()[part]))
    if not a.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: the suite measures GPUs; use --dry-run to check it on CPU")
    device = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.makedirs(a.out, exist_ok=True)
    failed = False
    for part in chosen:
        cases = [c for c in parts()[part] if not only or c.name in only]
        budget = a.budget if a.budget is not None else BUDGETS.get(part, 500.0)
        ctx = Context(device=device, dry_run=a.dry_run, out=a.out, deadline=time.monotonic() + budget)
        header = {"part": part, "device": device_line(device), "dry_run": a.dry_run, "budget_s": budget,
                  "planned_s": planned_s(part, cases), "planned": {c.name: c.est_s for c in cases},
                  "command": "python scripts/gpu_suite.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "date": time.strftime("%Y-%m-%d")}
        print(f"[{part}] device: {header['device']}{' (dry run, toy sizes)' if a.dry_run else ''}; planned "
              f"{header['planned_s']:.0f} s on an H100 of a {budget:.0f} s budget", flush=True)
        results = run_part(part, cases, ctx, header)
        failed |= any(r["status"] in ("fail", "error") for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
