"""The user-facing tools of issue 24 run on CPU and show what the run wrote: plot_metrics.py's
PNG holds exactly metrics.jsonl's numbers; estimate_memory.py --track shows a progress bar."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import plot_metrics  # noqa: E402


def _write_run(folder, rows):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _step(step, loss, scale=1.0):
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-4 * step * scale,
            "tokens_per_sec_per_device": 1000.0 + 10 * step * scale, "max_memory_gib": 0.5 + 0.01 * step * scale}


@pytest.mark.slow
def test_plot_metrics_png_holds_the_runs_numbers(tmp_path):
    # run A was resumed from step 2 after logging step 3: the resumed step 3 is the one plotted
    a = [_step(1, 5.0), _step(2, 4.0), _step(3, 9.9), {"step": 2, "validation_loss": 4.5, "validation_tokens": 64},
         _step(3, 3.0), _step(4, 2.5), {"step": 4, "validation_loss": 2.75, "validation_tokens": 64}]
    b = [_step(s, 6.0 - s, scale=2.0) for s in (1, 2, 3, 4, 5)]
    _write_run(tmp_path / "A", a)
    _write_run(tmp_path / "B", b)
    out = tmp_path / "both.png"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"), str(tmp_path / "A"),
                           str(tmp_path / "B"), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"wrote {out} (2 run(s))\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == (700, 1100) and image.std() > 0.01  # opens, and is not blank

    fig = plot_metrics.plot([str(tmp_path / "A"), str(tmp_path / "B")])
    lines = {line.get_gid(): (list(line.get_xdata()), list(line.get_ydata())) for ax in fig.axes for line in ax.lines}
    expected = {"A": {1: a[0], 2: a[1], 3: a[4], 4: a[5]}, "B": {r["step"]: r for r in b}}
    for run, rows in expected.items():
        for key in ("loss", "lr", "tokens_per_sec_per_device", "max_memory_gib"):
            assert lines[f"{run}:{key}"] == (sorted(rows), [rows[s][key] for s in sorted(rows)]), (run, key)
    assert lines["A:validation_loss"] == ([2, 4], [4.5, 2.75]) and "B:validation_loss" not in lines


def test_plot_metrics_refuses_a_folder_without_metrics(tmp_path):
    with pytest.raises(SystemExit, match=r"^plot_metrics: .*/nothing/metrics.jsonl does not exist \(give the run's "
                                         r"job.dump_folder\)$"):
        plot_metrics.main([str(tmp_path / "nothing")])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2 is not JSON"):
        plot_metrics.main([str(tmp_path / "bad")])


def test_plot_metrics_skips_a_last_line_cut_short(tmp_path, capsys):
    """A killed run leaves its last line half written: the run is still plotted, and the skip is said."""
    _write_run(tmp_path / "killed", [_step(1, 5.0), _step(2, 4.0)])
    with open(tmp_path / "killed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 3.')
    train, _ = plot_metrics.read_run(str(tmp_path / "killed"))
    assert sorted(train) == [1, 2]
    assert capsys.readouterr().err == (f"plot_metrics: {tmp_path / 'killed' / 'metrics.jsonl'}:3: skipped the last "
                                       f"line, cut short (the run was stopped while writing it)\n")


@pytest.mark.slow
def test_estimate_memory_track_shows_a_progress_bar():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "estimate_memory.py"), "--config",
                           "train_configs/debug_model.toml", "--world-size", "2", "--track", "--json",
                           "--training.seq_len", "128", "--training.local_batch_size", "1"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["tracked"]["measured"] > 0
    frames = proc.stderr.replace("\r", "\n").splitlines()
    done = [f for f in frames if f.startswith("--track: block forwards: 100%")]
    from titan_ulysses.planning.extrapolate import tracked_layer_counts
    from titan_ulysses.models.flavors import get_flavor

    # one step of one microbatch at each depth the tracker traces (3 and 4 of the 6 layers), no recomputation
    passes = sum(tracked_layer_counts(get_flavor("debugmodel").n_layers))
    assert passes == 7
    assert done and f"{passes}/{passes}" in done[-1], frames[-3:]


import show_sample  # noqa: E402

SFT = ["--config", "train_configs/debug_model.toml", "--training.dataset", "sft", "--training.dataset_path",
       "docs/examples/sft_train.jsonl", "--training.seq_len", "256", "--training.shuffle", "false"]


def _marked(text):
    body = text[text.index("---- document"):]  # after the legend line
    return [part.split(show_sample.CLOSE)[0] for part in body.split(show_sample.OPEN)[1:]]


def test_show_sample_marks_exactly_the_loss_tokens(tmp_path, capsys):
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "docs", "examples", "sft_train.jsonl"))]
    cache = ["--training.dataset_cache_dir", str(tmp_path / "cache")]
    show_sample.main([*SFT, *cache, "--training.packing", "false", "--index", "0"])
    out = capsys.readouterr().out
    assert "\nsample 0 of " in "\n" + out and "1 document(s)" in out
    assert f"<bos>{rows[0]['prompt']}{show_sample.OPEN}{rows[0]['completion']}<eos>{show_sample.CLOSE}" in out
    show_sample.main([*SFT, *cache, "--training.packing", "false", "--index", "1"])
    out = capsys.readouterr().out
    assistant = rows[1]["messages"][-1]["content"]
    assert _marked(out) == [f"{assistant}<|im_end|>\n"]  # ChatML: only the assistant turn and its end
    n_loss = int(out.split(" carry loss")[0].rsplit(" ", 1)[1])
    assert n_loss == len(f"{assistant}<|im_end|>\n".encode())  # byte tokenizer: one token per byte
    # packed: several samples per window, each completion marked, nothing of the prompts
    show_sample.main([*SFT, *cache, "--index", "0"])
    out = capsys.readouterr().out
    documents = out.count("---- document ")
    assert documents > 3 and len(_marked(out)) == documents
    completions = {r["completion"] + "<eos>" for r in rows if "completion" in r}
    answers = {r["messages"][-1]["content"] + "<|im_end|>\n" for r in rows if "messages" in r}
    assert all(m in completions | answers for m in _marked(out))


def test_show_sample_index_out_of_range_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^show_sample: --index 99999 is outside the \d+ samples of one epoch"):
        show_sample.main([*SFT, "--training.dataset_cache_dir", str(tmp_path / "c"), "--index", "99999"])


import plan  # noqa: E402


def test_plan_prints_a_toml_that_trains_and_fits(tmp_path, capsys):
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.preflight import validate
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import GIB, from_config
    from titan_ulysses.planning.recommend import BUDGET

    out = tmp_path / "plan.toml"
    memory = 0.12  # GiB: the debug model at 8K tokens needs a split and switches to fit
    argv = ["--flavor", "debugmodel", "--seq-len", "8192", "--gpus", "4", "--gpu-memory-gib", str(memory)]
    plan.main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    config = load_config(["--config", str(out)])
    dims = validate(config, 4)  # the TOML is a valid 4-GPU job
    assert dims.sp * dims.cp > 1 and config.training.seq_len == 8192
    args, layout, switches = from_config(config, dims)
    est = estimate(args, layout, switches, 8192, 1)
    assert est.total <= BUDGET * memory * GIB
    assert f"  {'total':<24} {est.total / GIB:8.2f} GiB of {memory:g}" in printed
    for name, value in est.phases.items():
        assert f"  {name:<24} {value / GIB:8.2f} GiB" in printed
    # the throughput estimate: FLOPs at the measured rates (which docs/benchmarks.md must hold)
    bench = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    assert f"{plan.MATMUL_TFLOPS:g} TFLOP/s matmul" in bench and "74% at 32K, 70% at 64K and 128K" in bench
    one = plan.tokens_per_second(args, 8192, "none", 100.0)
    assert plan.tokens_per_second(args, 8192, "none", 200.0)["tokens_per_sec_per_device"] == pytest.approx(
        2 * one["tokens_per_sec_per_device"])
    full = plan.tokens_per_second(args, 8192, "full", 100.0)  # a recomputed forward: 4/3 of the FLOPs
    assert full["tokens_per_sec_per_device"] == pytest.approx(0.75 * one["tokens_per_sec_per_device"])
    assert "throughput ESTIMATE (compute only, an upper bound)" in printed


def test_plan_says_when_nothing_fits():
    with pytest.raises(SystemExit, match=r"^plan: no layout of 1 GPUs and no memory switch fits seq_len 8192 in 90% "
                                         r"of 0.001 GiB"):
        plan.main(["--flavor", "debugmodel", "--seq-len", "8192", "--gpus", "1", "--gpu-memory-gib", "0.001"])


def test_plan_reads_a_hugging_face_folder(tmp_path, capsys):
    from hf_fixtures import make_hf_model, make_tokenizer

    from titan_ulysses.config.manager import load_config
    from titan_ulysses.preflight import validate
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.models.registry import num_params

    folder = str(tmp_path / "qwen3")
    make_hf_model(folder, "qwen3", {})
    make_tokenizer(folder)
    plan.main(["--hf-assets-path", folder, "--seq-len", "4096", "--gpus", "2", "--gpu-memory-gib", "0.1",
               "--out", str(tmp_path / "plan.toml")])
    printed = capsys.readouterr().out
    config = load_config(["--config", str(tmp_path / "plan.toml")])
    assert config.model.hf_assets_path == folder and config.model.tokenizer == "hf"
    validate(config, 2)
    args = load_hf_args(folder)
    assert f"# scripts/plan.py: {num_params(args) / 1e6:,.0f}M params, seq_len 4096, 2 GPUs of 0.1 GiB" in printed


def test_plan_runs_the_launchs_pre_flight(tmp_path):
    """A folder the trainer refuses is not planned for: a Phi-3 longrope of the wrong length, no tokenizer.json."""
    import json

    from hf_fixtures import make_tokenizer

    folder = tmp_path / "phi3"
    folder.mkdir()
    cfg = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=64, original_max_position_embeddings=16,
               rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3})
    (folder / "config.json").write_text(json.dumps(cfg))
    make_tokenizer(str(folder))
    argv = ["--hf-assets-path", str(folder), "--seq-len", "4096", "--gpus", "2", "--gpu-memory-gib", "80"]
    with pytest.raises(SystemExit, match=rf"^plan: model.hf_assets_path: {folder}/config.json: rope_scaling.short_factor "
                                         r"has 3 entries; longrope needs one per rotary frequency, 4 "):
        plan.main(argv)
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {**cfg["rope_scaling"],
                                                                            "short_factor": [1.0] * 4,
                                                                            "long_factor": [2.0] * 4}}))
    (folder / "tokenizer.json").unlink()  # its TOML says model.tokenizer hf: the launch would refuse it
    with pytest.raises(SystemExit, match=rf"^plan: model.hf_assets_path: no tokenizer.json at '{folder}/tokenizer.json'"):
        plan.main(argv)


def test_plan_and_plot_outputs_are_refused_in_one_line_never_overwritten_by_surprise(tmp_path, capsys):
    """Issue 38: --out into a missing folder was a traceback (both), and plan's --out replaced a file silently."""
    argv = ["--flavor", "debugmodel", "--seq-len", "4096", "--gpus", "1", "--gpu-memory-gib", "1"]
    with pytest.raises(SystemExit, match=rf"^plan: --out '{tmp_path}/no/plan.toml': the folder {tmp_path}/no does "
                                         r"not exist; create it or name a file in an existing folder$"):
        plan.main([*argv, "--out", str(tmp_path / "no" / "plan.toml")])
    out = tmp_path / "plan.toml"
    out.write_text("# mine")
    with pytest.raises(SystemExit, match=r"^plan: --out '.*plan.toml' exists; pass --overwrite to replace it, or "
                                         r"name a new file$"):
        plan.main([*argv, "--out", str(out)])
    assert out.read_text() == "# mine"
    plan.main([*argv, "--out", str(out), "--overwrite"])
    assert out.read_text().startswith("# scripts/plan.py") and not list(tmp_path.glob("*.tmp-*"))
    _write_run(tmp_path / "A", [_step(1, 2.0)])
    with pytest.raises(SystemExit, match=rf"^plot_metrics: --out '{tmp_path}/no/m.png': the folder {tmp_path}/no "
                                         r"does not exist"):
        plot_metrics.main([str(tmp_path / "A"), "--out", str(tmp_path / "no" / "m.png")])


@pytest.mark.parametrize("flag", ["--gpu-memory-gib", "--matmul-tflops"])
@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_plan_refuses_a_number_that_is_not_positive_and_finite(flag, value):
    argv = ["--flavor", "debugmodel", "--seq-len", "4096", "--gpus", "1", flag, value]
    with pytest.raises(SystemExit, match=f"^plan: {flag} must be a positive finite number, got "):
        plan.main(argv)


def test_plot_metrics_draws_sparse_killed_and_short_runs_readably(tmp_path, capsys):
    """Issue 32 item 5: a run logging every 10 steps and killed mid-line, beside a 600-step run: every point of the
    sparse run is marked, the loss axis is logarithmic, and the step axis too (the lengths differ 10x or more)."""
    _write_run(tmp_path / "sparse", [_step(s, 8.0 / s) for s in (10, 20, 30)])
    with open(tmp_path / "sparse" / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')
    _write_run(tmp_path / "long", [_step(s, 6.0 / s ** 0.5) for s in range(1, 601)])
    fig = plot_metrics.plot([str(tmp_path / "sparse"), str(tmp_path / "long")])
    assert "skipped the last line" in capsys.readouterr().err
    loss = fig.axes[0]
    assert loss.get_yscale() == "log" and loss.get_xscale() == "log"
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines}
    sparse, long = lines["sparse:loss"], lines["long:loss"]
    assert list(sparse.get_xdata()) == [10, 20, 30] and sparse.get_marker() == "o" and sparse.get_markevery() is None
    assert len(long.get_xdata()) == 600 and long.get_markevery() == [-1]  # dense: only its end marked
    assert sparse.get_label() == "sparse (30 steps)"
    fig.savefig(tmp_path / "out.png", dpi=50)
    short = plot_metrics.plot([str(tmp_path / "long")])  # one run: a linear step axis
    assert short.axes[0].get_xscale() == "linear"
