"""Datasets by `datasets` name or folder (``hf:NAME``, ``[training.hf_dataset]``), offline: the rows of a
save_to_disk folder and of a data-files folder give the tokens, the store and the global order that the
same rows give as a local .jsonl; bad input is one line naming the setting."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from titan_ulysses.config.manager import ConfigError, check_requirements, load_config
from titan_ulysses.interop import hf_datasets
from titan_ulysses.data.build import build_dataset, check_dataset_files, data_settings, open_store
from titan_ulysses.interop.hf_datasets import training_dataset_path
from titan_ulysses.data.sources import DataError, read_rows, text_field
from titan_ulysses.data.tokenizer import resolve_tokenizer

datasets = pytest.importorskip("datasets")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 5) for i in range(11)]
CHATS = [[{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i} " * (i + 1)}]
         for i in range(7)]


def _jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """The same rows as a .jsonl, a save_to_disk folder (SFT rows under another column) and a data-files folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    monkeypatch.setattr(hf_datasets, "ROWS_PER_ITEM", 4)  # several work items, in order
    hf_datasets.open_dataset.cache_clear()
    text_rows = [{"text": t} for t in TEXTS]
    out = {"text_jsonl": _jsonl(tmp_path / "text.jsonl", text_rows),
           "sft_jsonl": _jsonl(tmp_path / "sft.jsonl", [{"messages": c} for c in CHATS])}
    datasets.Dataset.from_list([{"body": t, "id": i} for i, t in enumerate(TEXTS)]).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"conv": c, "n": 1} for c in CHATS])}).save_to_disk(
        str(tmp_path / "saved_sft"))
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "saved_empty"))
    os.makedirs(tmp_path / "files")
    _jsonl(tmp_path / "files" / "part.jsonl", text_rows)
    out.update(saved=str(tmp_path / "saved"), saved_sft=str(tmp_path / "saved_sft"), files=str(tmp_path / "files"),
               empty=str(tmp_path / "saved_empty"))
    yield out
    hf_datasets.open_dataset.cache_clear()


def _config(tmp_path, kind, path):
    return load_config(["--training.dataset", kind, "--training.dataset_path", path, "--training.seq_len", "64",
                        "--training.dataset_cache_dir", str(tmp_path / "stores"), "--training.overlong_samples",
                        "truncate"])


def _same_store(a, b):
    assert a.n_docs == b.n_docs and np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert np.array_equal(np.asarray(a.offsets), np.asarray(b.offsets))
    assert (a.mask is None) == (b.mask is None)
    if a.mask is not None:
        assert np.array_equal(np.asarray(a.mask), np.asarray(b.mask))


@pytest.mark.parametrize("source", ["hf:{saved}?column=body", "hf:{files}"])
def test_text_rows_equal_the_jsonl(corpus, tmp_path, source):
    path = source.format(**corpus)
    config = _config(tmp_path, "text", path)
    tok = resolve_tokenizer(config.model)
    ours, ref = open_store("text", path, tok, config), open_store("text", corpus["text_jsonl"], tok, config)
    _same_store(ours, ref)
    assert ours.folder != ref.folder  # its own store, keyed by the split's fingerprint
    a, b = (build_dataset("text", p, tok, config, seed=3) for p in (path, corpus["text_jsonl"]))
    assert len(a) == len(b) > 1
    for i in range(len(a)):  # the same global order of windows
        assert all(np.array_equal(a[i][k], b[i][k]) for k in ("input", "labels", "document_ids")), i


def test_sft_messages_column_equals_the_jsonl(corpus, tmp_path):
    path = f"hf:{corpus['saved_sft']}?split=train&column=conv"
    config = _config(tmp_path, "sft", path)
    tok = resolve_tokenizer(config.model)
    _same_store(open_store("sft", path, tok, config), open_store("sft", corpus["sft_jsonl"], tok, config))


def test_the_table_is_the_same_source(corpus, tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[training]\ndataset = "text"\n[training.hf_dataset]\nname = "{corpus["saved"]}"\n'
                    f'column = "body"\n')
    config = load_config(["--config", str(toml), "--training.dataset_cache_dir", str(tmp_path / "stores")])
    check_requirements(config)
    assert training_dataset_path(config.training) == f"hf:{corpus['saved']}?column=body"
    check_dataset_files(config)
    tok = resolve_tokenizer(config.model)
    settings = data_settings(config, tok)
    assert settings["dataset_path"] == f"hf:{corpus['saved']}?column=body" and settings["dataset_content"]
    _same_store(open_store("text", training_dataset_path(config.training), tok, config),
                open_store("text", corpus["text_jsonl"], tok, config))


@pytest.mark.parametrize("argv, expected", [
    (["--training.hf_dataset.streaming", "true"], "training.hf_dataset.streaming true is not supported"),
    (["--training.hf_dataset.split", "test"], "training.hf_dataset.split is set but training.hf_dataset.name is not"),
    (["--training.hf_dataset.name", "a/b", "--training.dataset_path", "x.jsonl"], "both name the training data"),
    (["--training.hf_dataset.name", "a/b", "--training.dataset", "passkey"], "training.dataset is 'passkey'"),
])
def test_table_refusals(argv, expected):
    config = load_config(["--training.dataset", "text", *argv])
    with pytest.raises(ConfigError, match=expected):
        check_requirements(config)


def test_data_refusals_name_the_setting_in_one_line(corpus, tmp_path):
    cases = [(f"hf:{corpus['saved']}?column=nope", "no column 'nope' (columns: ['body', 'id'])"),
             (f"hf:{corpus['saved_sft']}?split=test", "no split 'test' (splits: ['train'])"),
             (f"hf:{corpus['saved']}?streaming=true", "streaming is not supported"),
             # issue 38: a split the dataset does not have was ignored (rows labelled [test]); an empty dataset read
             # "IndexError: list index out of range"
             (f"hf:{corpus['saved']}?split=test", "holds one Dataset, without splits; drop split=test"),
             (f"hf:{corpus['empty']}", f"an empty dataset: {corpus['empty']} holds no rows"),
             (f"hf:{corpus['saved']}?colum=body", "unknown option 'colum'"),
             ("hf:", "no dataset name"),
             (f"hf:{tmp_path}/missing", "the datasets library cannot load it")]
    for path, expected in cases:
        config = _config(tmp_path, "text", path)
        with pytest.raises(DataError) as e:
            check_dataset_files(config)
        message = str(e.value)
        assert message.startswith(f"training.dataset_path {path!r}") and expected in message, message
        assert "\n" not in message, message


def test_a_column_of_neither_text_nor_messages_is_refused_naming_what_works(corpus, tmp_path):
    """Its rows became {"messages": 1}, and the refusal suggested dataset 'sft', which failed next (issue 38)."""
    path = f"hf:{corpus['saved_sft']}?column=n"
    items, _ = hf_datasets.hf_items(path, "training.dataset_path")
    with pytest.raises(DataError) as e:
        next(read_rows(items[0]))
    assert str(e.value) == (f"{corpus['saved_sft']} [train] row 1: column 'n' is a int; it must hold text (a string, "
                            f"for dataset 'text') or chat messages (a list, for 'sft'): set column to one that does "
                            f"(columns: ['conv', 'n'])")
    where, _ = next(read_rows(hf_datasets.hf_items(f"hf:{corpus['saved']}", "training.dataset_path")[0][0]))
    assert where == f"{corpus['saved']} row 1"  # a Dataset without splits is labelled without one
    with pytest.raises(DataError) as e:  # a .jsonl's "messages" that are not a list: no 'sft' hint either
        text_field("rows.jsonl line 1", {"messages": 1})
    assert "sft" not in str(e.value)


@pytest.mark.slow
def test_training_from_a_datasets_folder_equals_the_jsonl(corpus, tmp_path):
    """train.py end to end: the same losses from the save_to_disk folder as from the .jsonl."""
    def train(path, name):
        cmd = [sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--training.dataset", "text",
               "--training.dataset_path", path, "--training.seq_len", "64", "--training.local_batch_size", "2",
               "--training.steps", "2", "--parallelism.ulysses_degree", "1", "--checkpoint.enable", "false",
               "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / name),
               "--training.dataset_cache_dir", str(tmp_path / "stores")]
        env = _single_rank_env(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert train(f"hf:{corpus['saved']}?column=body", "hf") == train(corpus["text_jsonl"], "jsonl")


def _single_rank_env(**extra) -> dict:
    """A world of one on a free port: plain `python train.py` would take 29500, which other runs may hold."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
            "PYTHONPATH": ROOT, **extra}


def test_config_names_the_configuration_whose_rows_are_read(corpus, tmp_path):
    """``hf:NAME?config=B`` hands config ``B`` to ``datasets`` (a dataset folder with two configurations, as a
    Hub repository declares them in its README): its rows, not the default configuration's."""
    folder = tmp_path / "two_configs"
    for name, rows in (("a", TEXTS[:4]), ("b", TEXTS[4:])):
        os.makedirs(folder / name)
        _jsonl(folder / name / "part.jsonl", [{"text": t} for t in rows])
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: A\n  data_files: a/*.jsonl\n  default: true\n"
                                      "- config_name: B\n  data_files: b/*.jsonl\n---\n")
    b_jsonl = _jsonl(tmp_path / "b.jsonl", [{"text": t} for t in TEXTS[4:]])
    config = _config(tmp_path, "text", b_jsonl)
    tok = resolve_tokenizer(config.model)
    _same_store(open_store("text", f"hf:{folder}?config=B", tok, config), open_store("text", b_jsonl, tok, config))
    a = open_store("text", f"hf:{folder}?config=A", tok, config)
    assert a.n_docs == 4  # the other configuration is other rows
