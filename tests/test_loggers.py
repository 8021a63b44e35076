"""Metrics loggers as peers (issue 24): console, metrics.jsonl, tensorboard and Weights & Biases
receive the same records, with system metrics, elapsed time and ETA; W&B runs offline under the
dump folder and a resume continues the same W&B run."""

import glob
import json
import os
import struct

import pytest

from dist_utils import run_distributed
from helpers import BASE, layout, read_metrics, train_worker
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import validate

wandb = pytest.importorskip("wandb")  # the dev extra installs it

RUN = BASE + layout(sp=2) + ["--checkpoint.enable", "true", "--checkpoint.interval", "2",
                             "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
                             "--metrics.enable_wandb", "true", "--metrics.wandb_tags", "ci,sp2"]


def _train_offline(argv):
    os.environ["WANDB_MODE"] = "offline"  # set in the rank itself: the forkserver keeps its own env
    os.environ["WANDB_SILENT"] = "true"
    train_worker(argv)


def wandb_records(path: str) -> list:
    """The records of a ``run-<id>.wandb`` file (W&B's LevelDB-style log of protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def history(records) -> dict[int, dict]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            out.setdefault(row.get("_step", r.history.step.num), {}).update(row)
    return out


def offline_runs(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*", "run-*.wandb")))


def test_wandb_offline_run_has_the_step_metrics_and_a_resume_continues_it(tmp_path):
    folder = tmp_path / "run"
    run_distributed(_train_offline, 2, RUN + ["--training.steps", "4", "--job.dump_folder", str(folder)])
    runs = offline_runs(folder)
    assert len(runs) == 1, runs  # rank 0 only
    run_id = (folder / "wandb" / "run_id").read_text().strip()
    assert runs[0].endswith(f"run-{run_id}.wandb")
    records = wandb_records(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.project == "titan-ulysses" and list(run.tags) == ["ci", "sp2"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["training"]["seq_len"] == 128 and config["parallelism"]["ulysses_degree"] == 2
    logged = history(records)
    metrics = read_metrics(folder)
    for row in metrics:  # every jsonl record, training and validation, is in the W&B history
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                assert logged[row["step"]][key] == pytest.approx(value, rel=1e-12), (row["step"], key)
    assert sorted(logged) == [1, 2, 3, 4]
    steps = [m for m in metrics if "loss" in m]
    assert all(m["host_rss_gib"] > 0.05 and 0 < m["data_wait_sec"] < 5 and m["elapsed_sec"] > 0 for m in steps)
    assert steps[0]["eta_sec"] > 0 and steps[-1]["eta_sec"] == 0
    assert [m["elapsed_sec"] for m in steps] == sorted(m["elapsed_sec"] for m in steps)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps_this_run"] == 4 and summary["tokens_this_run"] == 4 * 4 * 128
    assert summary["final_loss"] == steps[-1]["loss"]
    assert summary["validation_loss"] == metrics[-1]["validation_loss"] and summary["validation_step"] == 4
    assert summary["checkpoint"].endswith(os.path.join("checkpoint", "step-4"))

    run_distributed(_train_offline, 2, RUN + ["--training.steps", "6", "--job.dump_folder", str(folder)])
    runs = offline_runs(folder)
    assert len(runs) == 2 and all(r.endswith(f"run-{run_id}.wandb") for r in runs)  # the same W&B run
    assert (folder / "wandb" / "run_id").read_text().strip() == run_id
    resumed = history(wandb_records(runs[1]))
    assert sorted(resumed) == [5, 6]
    assert resumed[6]["loss"] == read_metrics(folder)[-2]["loss"]  # the last line is step 6's validation


def test_a_fresh_run_in_the_folder_gets_a_new_wandb_run(tmp_path, monkeypatch):
    from titan_ulysses.metrics.loggers.wandb_logger import run_id

    first = run_id(str(tmp_path), resumed=False)
    assert run_id(str(tmp_path), resumed=True) == first
    assert run_id(str(tmp_path), resumed=False) != first


@pytest.mark.parametrize("args, message", [
    (["--metrics.wandb_tags", "a,,b"], "metrics.wandb_tags 'a,,b' has an empty tag"),
    (["--metrics.wandb_tags", "x" * 65], "is longer than 64 characters"),
    (["--metrics.wandb_project", "team/proj"], "metrics.wandb_project 'team/proj' must be 1 to 128 characters"),
    (["--metrics.wandb_project", ""], "metrics.wandb_project '' must be"),
])
def test_wandb_settings_are_checked_before_any_process_group(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(load_config(["--metrics.enable_wandb", "true", *args]), 1)
    validate(load_config(args), 1)  # W&B off: its settings do not matter


def test_missing_wandb_package_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb needs the wandb package, which is not installed: "
                                          r"pip install 'titan_ulysses\[wandb\]'"):
        validate(load_config(["--metrics.enable_wandb", "true"]), 1)


def test_a_failed_wandb_login_is_one_line(tmp_path, monkeypatch):
    from titan_ulysses.config.job_config import Metrics
    from titan_ulysses.metrics.loggers.wandb_logger import WandbError, WandbLogger

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(WandbError, match=r"^metrics.enable_wandb: wandb.init failed \(api_key not configured "
                                         r"\(no-tty\).*\); run `wandb login`, or set WANDB_MODE=offline"):
        WandbLogger(str(tmp_path), Metrics(enable_wandb=True), {}, resumed=False)


def test_every_logger_gets_the_same_records(tmp_path, capsys):
    """The registry's loggers are peers: console, jsonl and tensorboard each see every record."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from titan_ulysses.config.job_config import Metrics
    from titan_ulysses.metrics.logger import MetricsLogger

    log = MetricsLogger(str(tmp_path), 0, Metrics(enable_tensorboard=True))
    rows = [{"step": s, "loss": 3.0 / s, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec_per_device": 100.0,
             "max_memory_gib": 0.5, "data_wait_sec": 0.002, "host_rss_gib": 0.4, "elapsed_sec": 65.0 * s,
             "eta_sec": 3725.0 / s} for s in (1, 2)]
    for row in rows:
        log.log(row)
    log.log_validation(2, {"validation_loss": 1.25, "validation_tokens": 512})
    log.close()
    out = capsys.readouterr().out
    assert "step     1  loss 3.0000" in out and "data_wait 2ms  elapsed 1m05s  eta 1h02m05s" in out
    assert "step     2  validation_loss 1.2500  tokens 512" in out
    assert read_metrics(tmp_path) == rows + [{"step": 2, "validation_loss": 1.25, "validation_tokens": 512}]
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*"))[0])
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 3.0), (2, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("validation_loss")] == [(2, 1.25)]
    assert MetricsLogger(str(tmp_path / "r1"), 1, Metrics(enable_tensorboard=True)).loggers == []
    assert not (tmp_path / "r1").exists()  # other ranks write nothing


def test_data_wait_is_the_time_inside_next():
    import time

    from titan_ulysses.metrics.system import WaitTimer

    def slow():
        for i in range(3):
            time.sleep(0.05)
            yield i

    timer, it = WaitTimer(), slow()
    assert [timer.next(it), timer.next(it)] == [0, 1]
    time.sleep(0.5)  # time outside next() is not waiting on data
    waited = timer.take()
    assert 0.1 <= waited < 0.45 and timer.take() == 0.0


def test_summary_lines(capsys):
    from titan_ulysses.metrics.loggers.console import ConsoleLogger
    from titan_ulysses.metrics.progress import RunProgress

    progress = RunProgress(start_step=4, total_steps=10, tokens_per_step=512)
    progress.last_loss, progress.validation = 1.5, (10, 1.25)
    summary = progress.summary(10, "out/checkpoint/step-10", "out/metrics.jsonl")
    assert summary["steps_this_run"] == 6 and summary["tokens_this_run"] == 3072
    ConsoleLogger().log_summary(summary)
    out = capsys.readouterr().out
    assert out.startswith("run summary: 6 steps this run (step 4 -> 10 of 10), 3,072 tokens in ")
    assert "final loss 1.5000, validation loss 1.2500 (step 10)\n  checkpoint: out/checkpoint/step-10\n" in out
    ConsoleLogger().log_summary(RunProgress(10, 10, 512).summary(10, "out/checkpoint/step-10", "m"))
    assert capsys.readouterr().out == ""  # the trainer's "all 10 steps of training.steps are done" line is the one


def test_login_problem_reads_the_sources_wandb_reads(tmp_path, monkeypatch):
    """The dry run's W&B check: refused only when none of wandb's login sources is there."""
    from titan_ulysses.metrics.loggers.wandb_logger import login_problem

    monkeypatch.chdir(tmp_path)
    netrc = tmp_path / "netrc"
    bare = {"NETRC": str(netrc), "WANDB_CONFIG_DIR": str(tmp_path / "cfg")}
    assert login_problem(bare).startswith("metrics.enable_wandb: no W&B login for api.wandb.ai (no WANDB_API_KEY")
    assert "no example.com entry" in login_problem({**bare, "WANDB_BASE_URL": "https://example.com"})
    for extra in ({"WANDB_API_KEY": "k"}, {"WANDB_MODE": "offline"}, {"WANDB_MODE": "disabled"},
                  {"WANDB_IDENTITY_TOKEN_FILE": "/tok"}):
        assert login_problem({**bare, **extra}) is None, extra
    netrc.write_text("machine api.wandb.ai login user password secret\n")
    assert login_problem(bare) is None
    assert login_problem({**bare, "WANDB_BASE_URL": "https://example.com"}) is not None
    netrc.unlink()
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "settings").write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert login_problem(bare) is None
