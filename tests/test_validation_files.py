"""An empty, malformed or mismatched validation file is one line naming it, at launch and in the dry run alike."""

import json
import os
import sys

import pytest

from titan_ulysses.config.manager import load_config
from titan_ulysses.data.build import build_data
from titan_ulysses.data.sources import DataError
from titan_ulysses.data.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    # name: (training.dataset, the validation file's content, what the line says)
    "empty": ("text", "", "holds no documents (empty file?)"),
    "blank-lines": ("text", "\n\n", "holds no documents (empty file?)"),
    "malformed": ("text", '{"text": "fine"}\n{"text": broken\n', "line 2: not a JSON object"),
    "sft-rows-for-text": ("text", json.dumps({"prompt": "q", "completion": "a"}) + "\n",
                          "line 1: field 'text' is missing; every row needs a string 'text' (fields found: "
                          "['completion', 'prompt']); these are SFT rows: set the dataset of this file"),
    "text-rows-for-sft": ("sft", json.dumps({"text": "plain"}) + "\n",
                          "line 1: field 'prompt' is missing; an SFT row needs 'prompt' and 'completion', or "
                          "'messages' (fields found: ['text']); a 'text' row is pretraining text"),
    "null-text": ("text", json.dumps({"text": None}) + "\n", "line 1: field 'text' is null"),
    "shorter-than-a-window": ("text", json.dumps({"text": "hi"}) + "\n",
                              "holds 4 tokens in documents of at least training.min_document_tokens = 0: fewer "
                              "than one window of training.seq_len = 128"),
}


def _train_file(tmp_path, kind):
    path = tmp_path / f"train-{kind}.jsonl"
    rows = [{"text": "hello world " * 40}] if kind == "text" else [{"prompt": "q " * 20, "completion": "a " * 20}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 20))
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_validation_file_is_one_line_naming_it(case, tmp_path, capsys):
    kind, content, message = CASES[case]
    bad = tmp_path / "validation.jsonl"
    bad.write_text(content)
    argv = ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--training.dataset", kind,
            "--training.dataset_path", _train_file(tmp_path, kind), "--training.seq_len", "128",
            "--training.dataset_cache_dir", str(tmp_path / "cache"), "--validation.enable", "true",
            "--validation.dataset_path", str(bad), "--parallelism.ulysses_degree", "1"]
    with pytest.raises(DataError) as launch:  # the launch builds the data after its process group: same call
        build_data(load_config(argv), ByteTokenizer(), 0, 1, 8)
    line = str(launch.value)
    assert str(bad) in line and message in line and "\n" not in line, line
    sys.path.insert(0, ROOT)
    import train

    capsys.readouterr()
    assert train.main([*argv, "--dry-run", "--world-size", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"data error: {line}"]
