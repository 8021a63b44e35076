"""Synthetic passkey retrieval, indexed by a global sample index, so every layout sees the same samples.

Datasets read from local files (pretraining text, SFT) live in ``windows.py`` over a
token store (``token_store.py``); ``build.py`` picks one from the config.

An item is a dict of 1-D LongTensors of length ``seq_len``: ``input``, ``labels`` (next
tokens, shifted on the full sequence, IGNORE_INDEX where there is no target),
``document_ids`` and ``positions`` (position within its document). A sample is built with
numpy from token arrays encoded once per dataset, never as a Python list of ``seq_len`` ints.
"""

from __future__ import annotations

import random

import numpy as np
import torch

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def _encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text, False, False), dtype=np.int64)


def passkey_fixed_parts(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(filler unit, question): the tokens every passkey sample of ``tokenizer`` shares, encoded once."""
    return _encode(tokenizer, _FILLER), _encode(tokenizer, " What is the pass key? The pass key is ")


def make_passkey_tokens(tokenizer, seq_len: int, passkey: int, depth: float,
                        fixed: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, int]:
    """``seq_len + 1`` tokens (int64): filler with the pass key at ``depth`` (0..1), the question and the
    answer last. ``fixed``: :func:`passkey_fixed_parts` of the tokenizer, when the caller keeps them.

    Returns the tokens and the index where the answer digits start.
    """
    unit, question = fixed if fixed is not None else passkey_fixed_parts(tokenizer)
    needle = _encode(tokenizer, f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ")
    answer = _encode(tokenizer, str(passkey))
    n_filler = seq_len + 1 - 1 - len(needle) - len(question) - len(answer)
    if n_filler < 0:
        raise ValueError(f"training.seq_len {seq_len} is too short for a passkey sample with this tokenizer (it needs "
                         f"at least {seq_len - n_filler} tokens): raise training.seq_len")
    filler = np.resize(unit, n_filler)  # the unit repeated, cut to n_filler
    cut = int(round(depth * n_filler))
    tokens = np.concatenate([np.array([tokenizer.bos_id], dtype=np.int64), filler[:cut], needle, filler[cut:],
                             question, answer])
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
        self._fixed = None  # passkey_fixed_parts, encoded at the first sample

    def __len__(self) -> int:
        return 2**31

    def key_and_depth(self, index: int) -> tuple[int, float]:
        rng = random.Random(self.seed * 1_000_003 + index)
        return random_passkey(rng, self.digits), rng.random()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One document: labels the next tokens (shifted on the full sequence), positions 0..seq_len-1."""
        key, depth = self.key_and_depth(index)
        if self._fixed is None:
            self._fixed = passkey_fixed_parts(self.tokenizer)
        t = torch.from_numpy(make_passkey_tokens(self.tokenizer, self.seq_len, key, depth, self._fixed)[0])
        # numpy fills: torch's parallel fill of a long row waits on its thread pool (40 ms at 128K under load)
        return {"input": t[:-1], "labels": t[1:], "document_ids": torch.from_numpy(np.zeros(self.seq_len, np.int64)),
                "positions": torch.from_numpy(np.arange(self.seq_len, dtype=np.int64))}
