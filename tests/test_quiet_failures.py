"""What was accepted silently, crashed, or was caught only by chance (issue 43, items 7-9), each refused in one
line or tested at its boundary directly.

* a ``[profiling]`` folder that cannot be written (under /proc) or names a file: both ranks died of SIGSEGV with
  no message, and the dry run passed it; now one line from the launch's checks and the dry run alike;
* a binary ``--config`` (UnicodeDecodeError), ``ulysses_degree = "many"`` (a hint to drop the quotes), an empty
  text file ("holds 2 tokens"), an all-NUL one (trained on); ``--training.dataset_path`` beside the passkey
  dataset (dropped silently; now said at start-up and in the dry run);
* ``training.gc_freq = 0`` in a step, the SDPA table's head_dim check, the profiling window's boundary, and the
  resume check of the newest checkpoint, each tested directly.
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import ROOT, layout, run
from titan_ulysses.config.manager import load_config
from titan_ulysses.config.profiling import Profiling, check_profiling

DEBUG = os.path.join(ROOT, "train_configs", "debug_model.toml")


@pytest.mark.parametrize("where", ["proc", "file"])
def test_a_profiling_folder_that_cannot_be_written_is_one_line_at_launch_and_in_the_dry_run(where, train_main,
                                                                                             tmp_path):
    folder = "/proc/titan-traces" if where == "proc" else str(tmp_path / "a-file")
    (tmp_path / "a-file").write_text("")
    for key in ("save_traces_folder", "save_memory_snapshot_folder"):
        enable = "enable_profiling" if key == "save_traces_folder" else "enable_memory_snapshot"
        argv = ["--config", DEBUG, "--job.dump_folder", str(tmp_path / "run"), f"--profiling.{enable}", "true",
                f"--profiling.{key}", folder]
        if key == "save_memory_snapshot_folder":  # refused on CPU anyway: the folder check alone, as a GPU sees it
            from titan_ulysses.runs.folders import output_folders_problem

            problem = output_folders_problem(load_config(argv[:4] + ["--profiling.enable_memory_snapshot", "true",
                                                                     f"--profiling.{key}", folder]))
            assert problem and problem.startswith(f"profiling.{key} '{folder}' "), problem
            continue
        # the dry run, and the launch's checks in this process (before any process group)
        for extra in (["--dry-run", "--world-size", "2"], ["--parallelism.ulysses_degree", "1"]):
            code, out, err = train_main(argv + extra)
            assert code == 2 and len(err) == 1, err
            reason = "is a file, not a folder" if where == "file" else "cannot be created in /proc"
            assert err[0].startswith(f"config error: profiling.{key} '{folder}' ") and reason in err[0], err


def test_tp_alone_on_cpu_passes_the_dry_run_as_it_trains(train_main, tmp_path):
    """The dry run said this launch was fine while it failed in fused AdamW; it trains now (the tp2 case of
    test_model_parallel steps the trainer's optimizer), and the dry run still says so."""
    code, out, err = train_main(["--config", DEBUG, "--job.dump_folder", str(tmp_path), "--parallelism.ulysses_degree",
                                 "1", "--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "false",
                                 "--dry-run", "--world-size", "2"])
    assert code == 0 and "'tp': 2" in out, err


def test_config_and_data_files_refused_in_one_line(train_main, tmp_path, capsys):
    from titan_ulysses.tools import estimate_memory

    binary = tmp_path / "binary.toml"
    binary.write_bytes(bytes(range(128, 256)) * 8)
    expected = f"config error: --config {binary}: not a TOML text file (byte 0 is not UTF-8); name a .toml config"
    code, _, err = train_main(["--config", str(binary), "--dry-run", "--world-size", "2"])
    assert code == 2 and err == [expected], err
    with pytest.raises(SystemExit) as exit_:
        estimate_memory.cli(["--config", str(binary), "--world-size", "2"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == expected

    many = tmp_path / "many.toml"
    many.write_text('[parallelism]\nulysses_degree = "many"\n')
    code, _, err = train_main(["--config", str(many), "--dry-run", "--world-size", "2"])
    assert code == 2 and err == [f"config error: parallelism.ulysses_degree expects int, got 'many' (a string in "
                                 f"{many}: write a whole number without quotes, e.g. ulysses_degree = 2)"], err
    many.write_text('[parallelism]\nulysses_degree = "2"\n')  # where dropping the quotes is the fix, it says so
    code, _, err = train_main(["--config", str(many), "--dry-run", "--world-size", "2"])
    assert code == 2 and err[0].endswith(f"(a string in {many}: write ulysses_degree = 2 without quotes)"), err

    base = ["--config", DEBUG, "--job.dump_folder", str(tmp_path / "run"), "--dry-run", "--world-size", "2"]
    text = ["--training.dataset", "text", "--training.dataset_path"]
    (tmp_path / "empty.txt").write_text("")
    code, _, err = train_main(base + text + [str(tmp_path / "empty.txt")])
    assert code == 2 and err == [f"data error: training.dataset_path '{tmp_path / 'empty.txt'}' holds no documents "
                                 f"(empty file?)"], err
    (tmp_path / "nul.txt").write_bytes(b"\0" * 300_000)
    code, _, err = train_main(base + text + [str(tmp_path / "nul.txt")])
    assert code == 2 and err == [f"data error: {tmp_path / 'nul.txt'}: not text (a NUL byte at byte 0: a binary "
                                 f"file?); name .txt files of UTF-8 text"], err


def test_a_dataset_path_the_passkey_dataset_does_not_read_is_said(train_main, tmp_path):
    """``--training.dataset passkey`` over a config with ``dataset_path`` (the documented way to try a config
    without its data) is honoured, and the unread path said in one line, at start-up and in the dry run."""
    from titan_ulysses.config.manager import unread_dataset_path

    data = str(tmp_path / "data")
    argv = ["--config", DEBUG, "--job.dump_folder", str(tmp_path / "run"), "--training.dataset_path", data]
    code, out, err = train_main(argv + ["--dry-run", "--world-size", "2"])
    assert code == 0 and f"training data: passkey (synthetic), 5-digit keys, sample 0 holds 512 tokens; " \
                         f"training.dataset_path '{data}' is not read\n" in out, err
    assert unread_dataset_path(load_config(argv)) == (
        f"the passkey dataset is synthetic: training.dataset_path '{data}' is not read (set training.dataset to "
        f"'text' or 'sft' to train on it)")
    assert unread_dataset_path(load_config(argv[:4])) is None


# -- boundaries tested directly (issue 43, item 9) ---------------------------------------------------

@pytest.mark.slow
def test_a_short_trainer_with_gc_freq_zero_and_an_unread_dataset_path(tmp_path, capfd):
    """``training.gc_freq = 0`` is Python's automatic collection: a run's steps never divide by it. The same
    run's start-up line says the passkey dataset does not read its ``training.dataset_path``."""
    data = str(tmp_path / "data")
    metrics = run(1, ["--training.steps", "1", "--training.gc_freq", "0", "--training.dataset_path", data]
                  + layout(), tmp_path, "gc0")
    assert [m["step"] for m in metrics] == [1]
    assert f"\nnote: the passkey dataset is synthetic: training.dataset_path '{data}' is not read" in capfd.readouterr().out


def test_sdpa_table_never_answers_for_an_unmeasured_head_dim():
    from titan_ulysses.ops.attention.sdpa_table import MEASURED, UNMEASURED, auto_causal, measured_row

    row = MEASURED[0]
    inside = (row.min_len + row.max_len) // 2
    assert measured_row(row.arch, row.head_dim, inside) is row
    hopper = (9, 0)
    for head_dim in (row.head_dim // 2, row.head_dim * 2):  # a length the row measures, a head_dim it did not
        assert measured_row(row.arch, head_dim, inside) is None
        assert auto_causal(hopper, head_dim, inside) == (UNMEASURED["hopper"], None)
    assert measured_row(row.arch, row.head_dim, row.max_len) is row  # inclusive at both ends
    assert measured_row(row.arch, row.head_dim, row.max_len + 1) is None


def test_the_profiling_window_may_fill_the_cycle_exactly():
    at = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=3, profiler_active=1)
    assert check_profiling(at) is None  # warmup + active == profile_freq: no wait, allowed
    over = Profiling(enable_profiling=True, profile_freq=4, profiler_warmup=3, profiler_active=2)
    assert check_profiling(over).startswith("profiling.profiler_warmup 3 + profiling.profiler_active 2 must be <= ")


def test_the_resume_check_reads_the_newest_checkpoint(tmp_path):
    """``check_resume`` compares the checkpoint a launch would resume, the newest: a misfit older one is
    not its business, a misfit newest one is refused (before, a check of the oldest was caught only through a
    message that named step-4)."""
    from titan_ulysses.checkpoint.fit import SettingsMismatchError, check_resume
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.run_spec import resolve_run

    config = load_config(["--config", DEBUG, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true"])
    args = resolve_run(config, tokenizer=False).args
    good = {f"model.{k}": v for k, v in Transformer(args).state_dict().items()}
    other = {"model.tok_embeddings.weight": torch.zeros(3, 5)}
    folder = tmp_path / config.checkpoint.folder

    def write(steps: dict):
        for step, state in steps.items():
            dcp.save(state, checkpoint_id=str(folder / f"step-{step}"), no_dist=True)

    write({1: good, 2: other})  # the newest does not fit: refused
    with pytest.raises(SettingsMismatchError, match=r"step-2 is good but does not fit"):
        check_resume(config, args)
    write({3: good})  # the newest fits; an older misfit is not what a launch resumes
    check_resume(config, args)
