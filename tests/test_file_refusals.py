"""Issue 20: damaged or inconsistent files are refused with one line before any weight is read
(a truncated safetensors shard, a config.json with fewer layers than the weights, a dump
folder that is a file, a missing corpus behind a layout error)."""

import json
import os
import sys

import pytest

from hf_fixtures import make_hf_model
from titan_ulysses.runs.folders import output_folder_problem
from titan_ulysses.interop.hf_weights import check_hf_weights
from titan_ulysses.interop.hf_config import load_hf_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf"))
    make_hf_model(folder, "llama", {}, max_shard_size="40KB")
    return folder


def _copy(folder, dest):
    import shutil

    shutil.copytree(folder, dest)
    return str(dest)


def test_a_truncated_shard_is_named(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "hf")
    check_hf_weights(folder, load_hf_args(folder))
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1]
    path = os.path.join(folder, shard)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)  # an interrupted copy
    with pytest.raises(ValueError, match=rf"^{path} is not a readable safetensors file \(SafetensorError: .*"
                                         rf"incomplete metadata.*\); download or copy it again"):
        check_hf_weights(folder, load_hf_args(folder))


def test_weights_of_more_layers_than_config_json_are_refused(sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "hf")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "num_hidden_layers": 1}, f)
    with pytest.raises(ValueError, match=r"hold \d+ tensor\(s\) of layers past config.json's num_hidden_layers 1, "
                                         r"e.g. 'model.layers.1.\w"):
        check_hf_weights(folder, load_hf_args(folder))


def test_a_dump_folder_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "run").write_text("not a folder")
    assert output_folder_problem("job.dump_folder", str(tmp_path / "run")).startswith(
        f"job.dump_folder '{tmp_path / 'run'}' is a file, not a folder")
    assert "in its path is a file" in output_folder_problem("job.dump_folder", str(tmp_path / "run" / "sub"))
    assert output_folder_problem("job.dump_folder", str(tmp_path / "new" / "run")) is None
    sys.path.insert(0, ROOT)
    import train

    assert train.main(["--job.dump_folder", str(tmp_path / "run"), "--model.flavor", "debugmodel",
                       "--parallelism.ulysses_degree", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: job.dump_folder") and "is a file" in err[0], err
    # issue 38: both passed --dry-run, then failed in os.makedirs with a traceback
    long = tmp_path / ("d" * 300)  # access() says yes (as root too); the folder cannot be made
    assert output_folder_problem("job.dump_folder", str(long)) == (
        f"job.dump_folder '{long}' cannot be created in {tmp_path} (File name too long); name a folder you can write")
    assert sorted(os.listdir(tmp_path)) == ["run"]  # the trial folder is gone
    dry = ["--model.flavor", "debugmodel", "--parallelism.ulysses_degree", "1", "--dry-run"]
    assert train.main([*dry, "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.enable", "true",
                       "--checkpoint.folder", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"config error: checkpoint.folder '{tmp_path / 'run'}' is a file, not a folder; name a folder (it is created "
        f"if missing)"]


def test_a_missing_corpus_is_reported_before_a_layout_error(tmp_path, capsys):
    sys.path.insert(0, ROOT)
    import train

    missing = str(tmp_path / "nope.jsonl")
    # plain `python train.py` is a world of 1; ulysses_degree 2 does not fit it, and the corpus is missing
    assert train.main(["--training.dataset", "text", "--training.dataset_path", missing,
                       "--parallelism.ulysses_degree", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"data error: training.dataset_path {missing!r} does not exist (a .txt/.jsonl/.parquet file "
                   f"or a folder of them)"], err


def test_a_broken_tokenizer_json_is_refused_before_any_process_group(tmp_path, capsys):
    from hf_fixtures import make_tokenizer

    hf = tmp_path / "hf"
    make_tokenizer(str(hf))
    text = (hf / "tokenizer.json").read_text()
    (hf / "tokenizer.json").write_text(text[: len(text) // 3])
    sys.path.insert(0, ROOT)
    import torch.distributed as dist

    import train

    assert train.main(["--model.tokenizer", "hf", "--model.tokenizer_path", str(hf), "--model.flavor", "debugmodel",
                       "--parallelism.ulysses_degree", "1", "--job.dump_folder", str(tmp_path / "run")]) == 2
    assert not dist.is_initialized()  # refused by the pre-flight, not after the process group
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: model.tokenizer_path") and \
        "is not a valid tokenizer.json" in err[0], err


def test_a_tensorboard_folder_that_cannot_be_one_is_refused_at_launch(tmp_path, capsys):
    """``tb`` a file under the dump folder: one line before any process group (an OSError traceback before)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").write_text("not a folder")
    sys.path.insert(0, ROOT)
    import train

    assert train.main(["--job.dump_folder", str(tmp_path / "run"), "--model.flavor", "debugmodel",
                       "--parallelism.ulysses_degree", "1", "--metrics.enable_tensorboard", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: metrics.enable_tensorboard: its tensorboard folder '{tmp_path / 'run' / 'tb'}' is "
                   f"a file, not a folder; name a folder (it is created if missing); or set "
                   f"metrics.enable_tensorboard false"], err
