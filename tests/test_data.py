"""Tokenizers, datasets, packing and the layout-independent loader state."""

import base64
import json

import pytest
import torch

from titan_ulysses.config.manager import load_config
from titan_ulysses.data.build import build_dataset
from titan_ulysses.data.datasets import PasskeyDataset, make_passkey_tokens
from titan_ulysses.data.sources import DataError
from titan_ulysses.data.loader import build_dataloader
from titan_ulysses.data.tokenizer import ByteTokenizer, TiktokenTokenizer, build_tokenizer
from titan_ulysses.ops.loss import IGNORE_INDEX


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == tok.bos_id == 256 and ids[-1] == tok.eos_id == 257
    assert tok.decode(ids) == "héllo ✓"
    assert tok.vocab_size == 264


def test_tiktoken_tokenizer_from_a_bpe_file(tmp_path):
    path = tmp_path / "tokenizer.model"
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tok = TiktokenTokenizer(str(path))
    assert tok.vocab_size == 260 + 256 and tok.bos_id == 260 and tok.eos_id == 261
    ids = tok.encode("hello hello")
    assert ids[0] == tok.bos_id and ids[1] == 259 and ids[-1] == tok.eos_id  # "hello" merged
    assert tok.decode(ids) == "hello hello"


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path .*nope.model"):
        build_tokenizer("tiktoken", str(tmp_path / "nope.model"))


def test_passkey_samples_are_deterministic_and_end_with_the_answer():
    tok = ByteTokenizer()
    ds = PasskeyDataset(tok, 300, seed=1)
    a, b = ds[7], ds[7]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(ds[7]["input"], PasskeyDataset(tok, 300, seed=2)[7]["input"])
    assert a["input"].shape == (300,)
    key, _ = ds.key_and_depth(7)
    text = tok.decode(a["input"].tolist() + [a["labels"][-1].item()])
    assert text.endswith(f"The pass key is {key}") and text.count(str(key)) == 3
    torch.testing.assert_close(a["labels"][:-1], a["input"][1:])  # labels shifted on the full sequence
    tokens, answer_start = make_passkey_tokens(tok, 300, 12345, 0.5)
    assert tok.decode(tokens[answer_start:]) == "12345" and len(tokens) == 301


@pytest.mark.parametrize("digits", [1, 3])
def test_passkey_digits_sets_the_key_length(digits):
    tok = ByteTokenizer()
    ds = PasskeyDataset(tok, 200, seed=3, digits=digits)
    keys = [ds.key_and_depth(i)[0] for i in range(200)]
    assert {len(str(k)) for k in keys} == {digits}
    assert len(set(keys)) == 10 if digits == 1 else len(set(keys)) > 100  # every 1-digit key, 0 included
    a = ds[5]
    text = tok.decode(a["input"].tolist() + [a["labels"][-1].item()])
    assert text.endswith(f"The pass key is {keys[5]}") and a["input"].shape == (200,)


def text_dataset(path, seq_len, *args):
    config = load_config(["--training.dataset", "text", "--training.dataset_path", str(path),
                          "--training.seq_len", str(seq_len), "--training.shuffle", "false", *args])
    return build_dataset("text", str(path), ByteTokenizer(), config, config.training.seed)


def test_packing_keeps_document_boundaries(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "abc"}) + "\n" + json.dumps({"text": "defgh"}) + "\n")
    (tmp_path / "b.txt").write_text("xy")
    ds = text_dataset(tmp_path, 8)
    # stream: [B a b c E][B d e f g h E][B x y E] = 5 + 7 + 4 = 16 tokens -> 2 windows
    item = ds[0]
    assert item["document_ids"].tolist() == [0] * 5 + [1] * 3
    assert item["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert item["labels"][4].item() == IGNORE_INDEX  # EOS of doc 0 does not predict doc 1's BOS
    assert item["labels"][:4].tolist() == item["input"][1:5].tolist()
    assert item["labels"][7].item() == ord("f")  # the next window's first token, same document
    assert ds[1]["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]  # positions restart in every window
    assert torch.equal(ds[2]["input"], ds[0]["input"])  # wraps around


def test_parquet_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")  # a dev dependency: installed in CI
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["abc", "defgh", "xy"]}), tmp_path / "d.parquet", row_group_size=2)
    item = text_dataset(tmp_path, 8)[0]
    assert item["document_ids"].tolist() == [0] * 5 + [1] * 3
    assert ByteTokenizer().decode(item["input"].tolist()) == "abcde"  # [B a b c E][B d e


def test_packing_too_little_text(tmp_path):
    (tmp_path / "a.txt").write_text("hi")
    with pytest.raises(DataError, match="fewer than one window of training.seq_len = 64"):
        text_dataset(tmp_path / "a.txt", 64)


def _steps(dp, local, steps, global_batch=8, state=None):
    """Per step, the sorted pass keys every rank of a dp group consumed."""
    ds = PasskeyDataset(ByteTokenizer(), 128, seed=0)
    loaders = [build_dataloader(ds, global_batch_size=global_batch, local_batch_size=local, dp_rank=r, dp_size=dp)
               for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        seen = []
        for it in iters:
            for _ in range(global_batch // (dp * local)):
                seen += [tuple(row.tolist()) for row in next(it)["input"]]
        out.append(sorted(seen))
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("dp,local", [(2, 4), (4, 2), (2, 1), (8, 1)])
def test_global_batch_is_the_same_at_every_layout(dp, local):
    reference, _ = _steps(1, 8, 3)
    assert _steps(dp, local, 3)[0] == reference


def test_resume_at_another_layout_continues_the_global_order():
    reference, _ = _steps(1, 8, 5)
    _, state = _steps(2, 2, 2)
    assert state["dataset_state"]["samples_consumed"] == 16
    resumed4, _ = _steps(4, 1, 3, state=state)
    resumed1, _ = _steps(1, 4, 3, state=state)
    assert resumed4 == reference[2:] and resumed1 == reference[2:]


def test_global_batch_must_split_evenly():
    with pytest.raises(ValueError, match="training.global_batch_size 6 is not a multiple"):
        build_dataloader(PasskeyDataset(ByteTokenizer(), 128, 0), global_batch_size=6, local_batch_size=4, dp_rank=0, dp_size=1)
