"""The GPU suite's dry run (toy sizes on CPU) runs every case function, so the suite cannot rot
between the rare sessions that have a GPU; and what its first GPU run found stays fixed."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One case for each case function, the others differ only in their arguments; except
# checkpoint_async_pinned_resume and compile_memory_switches, which run train.py through the
# same helper as trainer_1b_sp1 and float8_rowwise (their paths have their own tests on CPU:
# test_checkpoint.py, test_compile.py) and would add three minutes to CI.
DRY = {
    "correctness": ["attn_sdpa_flash", "attn_sdpa_cudnn", "attn_sdpa_docmask", "attn_flex_docmask",
                    "attn_flash_attn_pkg", "attn_sdpa_lower_right_cp", "attn_sdpa_docs_window_softcap",
                    "attn_flex_docs_window_softcap", "attn_flash_attn_docs_window_softcap", "attn_sdpa_cp4_docs_window",
                    "attn_flex_cp4_docs_window_softcap", "attn_sdpa_priority_auto", "multiprocess_one_gpu",
                    "hf_llama_ulysses_bf16", "loss_fused_bf16", "hf_sft_ulysses_bf16",
                    "full_offload_equals_full", "compile_one_step", "float8_rowwise", "trainer_1b_sp1"],
    # (profile_8b_stages is not here: its profile_cell subprocess is first's profile_1b_16k's, 20 s at toy size)
    "bench": ["bench_attention", "bench_packed_128k", "bench_rates", "8b_128k_sim8_compile_bf16_full_offload_snapshot",
              "hf_memory_bf16"],
    "limits": ["estimate_validate_8b_32k", "longest_1b_one_gpu"],
    # its train.py cells only build their command lines in a dry run (benchmarks/perf_ab.py)
    "perf": ["perf_1b_16k_default", "perf_prefetch_off", "perf_sync_free_off", "perf_loss_materialized",
             "perf_loss_chunked",
             "perf_sdpa_order_hd64", "perf_fsdp_one_rank", "perf_liger"],
}
# the short parts' own case functions (their other cases are the long parts' functions, run above).
# second's float8 cell runs train_cell, which headline and peer_1b_16k run here too (its offload case and rest's
# rates are bench's too: they run above); rest's
# limits_6m_staged_two_layers_1m runs run_trial (longest_1b_one_gpu above) and _estimate_gib (headline).
DRY_SHORT = {
    "first": ["features_multirank", "families_bf16", "peer_1b_16k", "profile_1b_16k", "perf_loss",
              "headline_8b_128k_sim8_planned"],
}
# CUDA-only kernels and packages the CPU machine lacks: the only skips a dry run may report
MAY_SKIP = {"attn_sdpa_cudnn": "CUDA kernel", "attn_flash_attn_pkg": "not installed",
            "attn_flash_attn_docs_window_softcap": "not installed"}


def _dry_run(tmp_path, part: str, dry: dict):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_suite.py", "--part", part, "--dry-run", "--out", str(tmp_path),
         "--budget", "900", "--only", ",".join(name for names in dry.values() for name in names)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    for part, names in dry.items():
        report = json.loads((tmp_path / f"{part}.json").read_text())
        rows = {r["name"]: r for r in report["results"]}
        assert sorted(rows) == sorted(names), proc.stderr[-2000:]
        for name, row in rows.items():
            if name in MAY_SKIP:
                assert row["status"] == "skipped" and MAY_SKIP[name] in row["detail"], row
            else:
                assert row["status"] in ("pass", "measured"), (row, proc.stderr[-3000:])
        table = (tmp_path / f"{part}.md").read_text()
        assert all(f"| {name} |" in table for name in names) and "CPU" in report["device"]
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_dry_run_runs_every_case_function(tmp_path):
    _dry_run(tmp_path, "all", DRY)  # one launch for the long parts and perf (each with its own budget and report)


@pytest.mark.slow
@pytest.mark.parametrize("part", list(DRY_SHORT))
def test_short_parts_dry_run(tmp_path, part):
    _dry_run(tmp_path, part, {part: DRY_SHORT[part]})


def test_short_parts_fit_their_gpu_windows():
    """first: 450 s on an H100 (wheel install and start-up included: with a machine's start about 10 minutes of a
    15-minute window, room for second); second: 180 s on a started machine; perf: 300 s.
    Planned from each case's estimate; every case is a name the part's report will show."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_suite

    limits = {"first": 450, "second": 180, "perf": 300}
    for part, limit in limits.items():
        cases = gpu_suite.parts()[part]
        assert 0 < gpu_suite.planned_s(part, cases) <= limit, (part, gpu_suite.planned_s(part, cases))
        assert len({c.name for c in cases}) == len(cases)


def test_every_correctness_case_of_the_suite_is_a_gpu_test():
    """The suite's correctness cases (functions of tests/gpu/) all run under pytest's ``gpu`` marker
    too (tests/gpu/test_cases.py), by the same names; the rest are benchmarks/'."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_suite
    from gpu.test_cases import CASES

    tested = {c.name for c in CASES}
    for part, cases in gpu_suite.parts().items():
        for case in cases:
            module = case.fn.__module__
            assert module.split(".")[0] in ("gpu", "benchmarks"), (part, case.name, module)
            if module.startswith("gpu."):
                assert case.name in tested, (part, case.name)


@pytest.mark.parametrize("part", ["first", "second", "perf", "correctness", "bench", "limits"])
def test_a_misspelt_case_is_refused_before_any_work(part, capsys):
    """A misspelt ``--only`` name is refused at once (exit 2, the part's cases listed), not found out
    after the GPU machine has started; every listed name is accepted."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import gpu_suite

    names = [c.name for c in gpu_suite.parts()[part]]
    assert names
    with pytest.raises(SystemExit) as e:
        gpu_suite.main(["--part", part, "--dry-run", "--only", f"{names[0]},no_such_case", "--out", "/nonexistent"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"no case no_such_case in --part {part}; its cases: {', '.join(names)}" in err, err


@pytest.mark.slow
def test_suite_refuses_to_measure_without_a_gpu():
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "scripts/gpu_suite.py", "--part", "bench", "--out", "/tmp/x"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr


def _one_rank_computes_in_bf16():
    from model_harness import small_args

    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder

    pd = ParallelDims(world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    seen = []
    for dtype in (torch.bfloat16, torch.float32):
        model = Transformer(small_args())
        model.init_weights()
        parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=dtype))
        hook = model.layers["0"].feed_forward.w1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        model(torch.randint(0, 64, (1, 8)))
        hook.remove()
    # the first GPU run found one-GPU jobs training in fp32 whatever mixed_precision_param said
    assert seen == [torch.bfloat16, torch.float32]


def test_one_rank_honours_mixed_precision_param():
    run_distributed(_one_rank_computes_in_bf16, 1)


def test_perf_cells_differ_from_the_default_by_one_setting_each():
    """The A/B cells' command lines (a dry run builds them without running them): each adds one setting
    to the default cell, the agreed names (two are added beside this part; the lead checks them at merge)."""
    from benchmarks.perf_ab import AB, cell_command

    base = cell_command("perf_1b_16k_default")
    added = {name: cell_command(name)[len(base):] for name in AB if name != "perf_1b_16k_default"}
    assert all(cell_command(name)[:len(base)] == base for name in AB)
    assert added == {"perf_prefetch_off": ["--training.prefetch_batches", "0"],
                     "perf_sync_free_off": ["--training.sync_free_step", "false"],
                     "perf_loss_materialized": ["--model.loss_backend", "materialized"],
                     "perf_loss_chunked": ["--model.loss_backend", "chunked", "--model.loss_chunk_size", "8192"]}
