"""The benchmark scripts run and their search logic is right (no timing is asserted here:
performance figures come from running the scripts, see docs/benchmarks.md)."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import bench_attention  # noqa: E402
import bench_train  # noqa: E402
import make_tiny_hf  # noqa: E402
import max_seq_len  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_attention_measures_every_backend(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench_attention.main(["--seq-lens", "64,128", "--iters", "1", "--warmup", "1",
                                 "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {(r["backend"], r["seq_len"]) for r in rows} == {
        (b, s) for b in ("sdpa_cpu_flash", "sdpa_math") for s in (64, 128)
    }
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["matmul_tflops"] > 0 for r in rows)
    assert "device: CPU" in capsys.readouterr().out


def test_max_seq_len_doubles_then_bisects_to_the_precision(monkeypatch, capsys):
    tried = []

    def fits(a, seq_len):  # a device on which everything up to 5000 tokens fits
        tried.append(seq_len)
        return seq_len <= 5000

    monkeypatch.setattr(max_seq_len, "trains", fits)
    max_seq_len.main(["--config", "x.toml", "--start", "1024", "--multiple", "256"])
    assert tried[:4] == [1024, 2048, 4096, 8192]
    assert "longest seq_len that trains: 4864 (first failing length 5120)" in capsys.readouterr().out


def test_max_seq_len_refuses_a_start_off_the_grid():
    with pytest.raises(SystemExit, match="--start 1000 must be a positive multiple of --multiple 256"):
        max_seq_len.main(["--config", "x.toml", "--start", "1000", "--multiple", "256"])


def test_bench_train_runs_a_cell_and_reports_it(capsys):
    bench_train.main(["--config", "train_configs/debug_model.toml", "--compile", "off", "--precision", "fp32",
                      "--ac", "full", "--steps", "3", "--warmup", "1", "--seq-len", "128",
                      "--extra", "--parallelism.ulysses_degree 1"])
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("off")][0]
    assert line.split()[:3] == ["off", "fp32", "full"] and line.endswith("ok"), line


def test_bench_step_overhead_times_both_sides_and_prints_the_ratio(tmp_path):
    folder = str(tmp_path / "tiny")
    assert make_tiny_hf.main(["llama", folder]) == 0
    # its own process: the trainer joins a process group of one
    proc = subprocess.run([sys.executable, "scripts/bench_step_overhead.py", "--hf-folder", folder, "--seq-len", "64",
                           "--rounds", "1", "--warmup", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for line in ("  ours step", "  bare step", "around the model", "ratio ours / bare, whole step:",
                 "around the model, ours - bare:", "device: CPU", "command: python scripts/bench_step_overhead.py"):
        assert line in out, out
