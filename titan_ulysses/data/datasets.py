"""Synthetic passkey retrieval, indexed by a global sample index, so every layout sees the same samples.

Datasets read from local files (pretraining text, SFT) live in ``windows.py`` over a
token store (``token_store.py``); ``build.py`` picks one from the config.

An item is a dict of 1-D LongTensors of length ``seq_len``: ``input``, ``labels`` (next
tokens, shifted on the full sequence, IGNORE_INDEX where there is no target),
``document_ids`` and ``positions`` (position within its document).
"""

from __future__ import annotations

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
        raise ValueError(f"training.seq_len {seq_len} is too short for a passkey sample with this tokenizer (it needs "
                         f"at least {seq_len - n_filler} tokens): raise training.seq_len")
    unit = tokenizer.encode(_FILLER, False, False)
    filler = (unit * (n_filler // len(unit) + 1))[:n_filler]
    cut = int(round(depth * n_filler))
    tokens = [tokenizer.bos_id] + filler[:cut] + needle + filler[cut:] + question + answer
    return tokens, len(tokens) - len(answer)


def check_passkey_fits(tokenizer, seq_len: int, digits: int) -> None:
    """A ValueError of one line when ``seq_len`` cannot hold a passkey sample with this tokenizer."""
    make_passkey_tokens(tokenizer, seq_len, 10**digits - 1, 0.5)


def random_passkey(rng: random.Random, digits: int) -> int:
    """A key of exactly ``digits`` digits (no leading zero unless it is the only digit)."""
    return rng.randrange(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


class PasskeyDataset:
    """Synthetic passkey retrieval, generated from (seed, index): a ``digits``-digit key at a random depth."""

    packed = False  # one document per row

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
