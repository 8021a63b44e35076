"""Map-style datasets indexed by a global sample index, so every layout sees the same samples.

An item is a dict of 1-D LongTensors of length ``seq_len``: ``input``, ``labels`` (next
tokens, shifted on the full sequence, IGNORE_INDEX where there is no target),
``document_ids`` and ``positions`` (position within its document).
"""

from __future__ import annotations

import glob
import json
import os
import random

import torch

from titan_ulysses.ops.loss import IGNORE_INDEX

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def _item(tokens: list[int], doc_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
    """seq_len + 1 tokens -> an item; labels across a document boundary are ignored."""
    t = torch.tensor(tokens, dtype=torch.long)
    docs = torch.zeros_like(t) if doc_ids is None else torch.tensor(doc_ids, dtype=torch.long)
    labels = t[1:].clone()
    labels[docs[1:] != docs[:-1]] = IGNORE_INDEX
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    idx = torch.arange(len(docs))
    positions = idx - torch.cummax(torch.where(starts, idx, 0), dim=0).values
    return {"input": t[:-1], "labels": labels, "document_ids": docs[:-1], "positions": positions[:-1]}


def make_passkey_tokens(tokenizer, seq_len: int, passkey: int, depth: float) -> tuple[list[int], int]:
    """``seq_len + 1`` tokens: filler with the pass key at ``depth`` (0..1), the question and the answer last.

    Returns the tokens and the index where the answer digits start.
    """
    needle = tokenizer.encode(f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ", False, False)
    question = tokenizer.encode(" What is the pass key? The pass key is ", False, False)
    answer = tokenizer.encode(str(passkey), False, False)
    n_filler = seq_len + 1 - 1 - len(needle) - len(question) - len(answer)
    if n_filler < 0:
        raise ValueError(f"training.seq_len {seq_len} is too short for a passkey sample (it needs at least {seq_len - n_filler})")
    unit = tokenizer.encode(_FILLER, False, False)
    filler = (unit * (n_filler // len(unit) + 1))[:n_filler]
    cut = int(round(depth * n_filler))
    tokens = [tokenizer.bos_id] + filler[:cut] + needle + filler[cut:] + question + answer
    return tokens, len(tokens) - len(answer)


def random_passkey(rng: random.Random, digits: int) -> int:
    """A key of exactly ``digits`` digits (no leading zero unless it is the only digit)."""
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


class PasskeyDataset:
    """Synthetic passkey retrieval, generated from (seed, index): a ``digits``-digit key at a random depth."""

    def __init__(self, tokenizer, seq_len: int, seed: int, digits: int = 5):
        self.tokenizer, self.seq_len, self.seed, self.digits = tokenizer, seq_len, seed, digits

    def __len__(self) -> int:
        return 2**31

    def key_and_depth(self, index: int) -> tuple[int, float]:
        rng = random.Random(self.seed * 1_000_003 + index)
        return random_passkey(rng, self.digits), rng.random()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        key, depth = self.key_and_depth(index)
        tokens, _ = make_passkey_tokens(self.tokenizer, self.seq_len, key, depth)
        return _item(tokens)


def _read_documents(path: str) -> list[str]:
    files = sorted(
        f for ext in ("txt", "jsonl", "parquet") for f in glob.glob(os.path.join(path, f"*.{ext}"))
    ) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise FileNotFoundError(f"training.dataset_path {path!r} has no .txt, .jsonl or .parquet file")
    docs = []
    for f in files:
        if f.endswith(".jsonl"):
            with open(f) as fh:
                docs += [json.loads(line)["text"] for line in fh if line.strip()]
        elif f.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise ImportError(f"reading {f} needs pyarrow: pip install pyarrow") from e
            docs += [t for t in pq.read_table(f, columns=["text"]).column("text").to_pylist() if t]
        else:
            with open(f) as fh:
                docs.append(fh.read())
    return docs


class PackedTextDataset:
    """Local documents tokenized with BOS/EOS, concatenated and cut into seq_len windows.

    Window i covers tokens ``[i*seq_len, i*seq_len + seq_len + 1)`` of the stream, so labels
    tile the stream exactly; indices wrap around (epochs).
    """

    def __init__(self, path: str, tokenizer, seq_len: int):
        self.seq_len = seq_len
        tokens, doc_ids = [], []
        for d, text in enumerate(_read_documents(path)):
            ids = tokenizer.encode(text)
            tokens += ids
            doc_ids += [d] * len(ids)
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"training.dataset_path {path!r} holds {len(tokens)} tokens, fewer than training.seq_len + 1 = {seq_len + 1}"
            )
        self.tokens, self.doc_ids = tokens, doc_ids
        self.n_windows = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = (index % self.n_windows) * self.seq_len
        end = start + self.seq_len + 1
        return _item(self.tokens[start:end], self.doc_ids[start:end])


def build_dataset(kind: str, path: str, tokenizer, seq_len: int, seed: int, passkey_digits: int):
    if kind == "passkey":
        return PasskeyDataset(tokenizer, seq_len, seed, passkey_digits)
    if kind == "text":
        return PackedTextDataset(path, tokenizer, seq_len)
    raise ValueError(f"training.dataset {kind!r} is not one of ['passkey', 'text']")
