"""The installed commands (issue 32 item 2): a non-editable ``pip install`` of this checkout, then every console
command from a folder outside the repository, the shipped configs by name, and train.py's usage and ``--help``."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.config.shipped import config_path, shipped_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("titan-train", "titan-export", "titan-plan", "titan-estimate", "titan-eval-needle", "titan-eval-long",
            "titan-generate", "titan-prepare-data", "titan-plot-metrics")


def test_shipped_configs_resolve_by_name_and_refuse_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the repository: train_configs/ is not here
    assert set(shipped_configs()) >= {"debug_model", "llama3_8b_128k", "needle_demo"}
    for value in ("debug_model", "debug_model.toml", "train_configs/debug_model.toml"):
        assert os.path.samefile(config_path(value), os.path.join(ROOT, "train_configs", "debug_model.toml"))
    assert load_config(["--config", "llama3_8b_128k"]).training.seq_len == 131072
    (tmp_path / "debug_model.toml").write_text("[training]\nsteps = 3\n")  # a file of that name wins
    assert load_config(["--config", "debug_model.toml"]).training.steps == 3
    with pytest.raises(ConfigError) as e:
        load_config(["--config", "llama3_8b_128"])
    assert "\n" not in str(e.value) and "nor is it a shipped config" in str(e.value) and "llama3_8b_128k" in str(e.value)
    # issue 38: a folder is not "no such file": it is named a folder, with the TOML files in it
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "mine.toml").write_text("")
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path / 'configs'} is a folder, not a TOML file; the TOML "
                                          rf"files there: mine.toml \(e.g. --config {tmp_path / 'configs' / 'mine.toml'}\)"):
        load_config(["--config", str(tmp_path / "configs")])


def test_estimate_refuses_a_bad_config_with_exit_code_2(capsys):
    """Issue 38: titan-estimate exited 1 on a config error (train.py and the other commands exit 2)."""
    from titan_ulysses.tools.estimate_memory import cli

    with pytest.raises(SystemExit) as e:
        cli(["--config", "no_such_config", "--world-size", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("config error: --config no_such_config: "), err


def test_a_bare_train_prints_the_usage_and_help_prints_one_section(capsys):
    sys.path.insert(0, ROOT)
    import train

    assert train.main([]) == 2  # nothing starts
    err = capsys.readouterr().err
    assert "usage: torchrun" in err and "debug_model" in err and "llama3_8b_128k" in err and "relative to the working" in err
    assert train.main(["--help", "training"]) == 0
    out = capsys.readouterr().out
    assert "[training]" in out and "--training.seq_len" in out and "[model]" not in out and "usage" not in out
    assert train.main(["--help", "trainin"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no such section" in err and "lora" in err


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``pip install`` (not editable) of a copy of the checkout into a target folder: (its bin/, environment)."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("titan_ulysses", "train_configs"):
        shutil.copytree(os.path.join(ROOT, name), source / name, symlinks=True, ignore=ignore)
    target = base / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = target / "titan_ulysses" / "configs" / "debug_model.toml"
    assert shipped.is_file() and not shipped.is_symlink()  # package data: the file itself, not a link into a checkout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCHELASTIC_ERROR_FILE")}
    return target / "bin", dict(env, PYTHONPATH=str(target))


def _run(argv, env, cwd, timeout=300):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_installed_commands_run_outside_the_repository(installed, tmp_path):
    bin_dir, env = installed
    where = _run([sys.executable, "-c", "import titan_ulysses; print(titan_ulysses.__file__)"], env, tmp_path)
    assert where.stdout.startswith(str(bin_dir.parent)), where.stdout + where.stderr  # the installed copy
    for command in COMMANDS:
        proc = _run([str(bin_dir / command), "--help"], env, tmp_path)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower() + proc.stderr.lower(), (command, proc.stderr)
    bare = _run([str(bin_dir / "titan-train")], env, tmp_path)
    assert bare.returncode == 2 and "shipped configs" in bare.stderr and "needle_demo" in bare.stderr
    assert not (tmp_path / "outputs").exists()  # nothing started
    estimate = _run([str(bin_dir / "titan-estimate"), "--config", "llama3_8b_128k", "--world-size", "8"], env, tmp_path)
    assert estimate.returncode == 0 and "GiB" in estimate.stdout, estimate.stderr[-2000:]
    plan = _run([str(bin_dir / "titan-plan"), "--flavor", "debugmodel", "--seq-len", "1024", "--gpus", "1",
                 "--out", "plan.toml"], env, tmp_path)
    assert plan.returncode == 0 and (tmp_path / "plan.toml").is_file(), plan.stderr[-2000:]
    missing = _run([str(bin_dir / "titan-estimate"), "--config", "no_such_config", "--world-size", "8"], env, tmp_path)
    assert missing.returncode != 0 and "debug_model" in missing.stderr


@pytest.mark.slow
def test_the_training_module_runs_a_shipped_config_outside_the_repository(installed, tmp_path):
    _, env = installed
    with socket.socket() as s:  # a plain one-process run otherwise listens on 29500, which another job may hold
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    proc = _run([sys.executable, "-m", "titan_ulysses.train", "--config", "debug_model", "--training.steps", "1",
                 "--training.seq_len", "128", "--training.local_batch_size", "1", "--parallelism.ulysses_degree", "1",
                 "--checkpoint.enable", "false", "--job.dump_folder", "run"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # the config's paths: relative to the working directory
