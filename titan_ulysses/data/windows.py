"""Datasets that read ``seq_len`` windows lazily from a token store, in a seeded order.

Global sample ``i`` is window ``order_e[i mod n]`` of epoch ``e = i div n``, where
``order_e`` is a permutation drawn from ``(seed, e)``: the same at every layout (the
loader hands out global indices), exactly resumable (the index is the state), and
different in every epoch. With ``shuffle = False`` windows come in corpus order.

A window is a list of pieces ``(document, start, length)`` of at most ``seq_len`` tokens
in all. Every piece's tokens are inputs; its labels are the next tokens *of the same
document* (IGNORE_INDEX past the document's end, and, for SFT without
``include_prompt``, on targets that are not completion tokens). Positions restart at 0 in
every piece, document ids count the pieces of the window, and the rest of the window is
padding (``pad_id``, labels ignored, document id -1).

* ``StreamWindows``: pretraining; the kept documents back to back, cut every ``seq_len``
  tokens (Megatron/torchtitan packing; a document may continue in the next window).
* ``DocumentWindows``: one document (or SFT sample) per window, truncated or padded.
* ``PackedSamples``: whole SFT samples packed into windows by best-fit decreasing.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from titan_ulysses.data.token_store import TokenStore
from titan_ulysses.ops.loss import IGNORE_INDEX


class WindowDataset:
    packed = True  # a row may hold several documents: attention needs the document mask

    def __init__(self, store: TokenStore, seq_len: int, seed: int, shuffle: bool, pad_id: int,
                 include_prompt: bool = True):
        self.store, self.seq_len, self.seed, self.shuffle = store, seq_len, seed, shuffle
        self.pad_id, self.include_prompt = pad_id, include_prompt
        self._order = (None, None)  # (epoch, permutation)
        self.stats: dict[str, int] = {"documents": store.n_docs}

    # subclasses: n_windows and pieces(window) -> [(doc, start, length)], truncated count
    n_windows: int

    def pieces(self, window: int) -> tuple[list[tuple[int, int, int]], int]:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.n_windows

    def window_of(self, index: int) -> int:
        epoch, j = divmod(index, self.n_windows)
        if not self.shuffle:
            return j
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return int(self._order[1][j])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pieces, truncated = self.pieces(self.window_of(index))
        return self.assemble(pieces, truncated)

    def assemble(self, pieces, truncated: int = 0) -> dict[str, torch.Tensor]:
        s, store = self.seq_len, self.store
        inputs = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, IGNORE_INDEX, dtype=np.int64)
        docs = np.full(s, -1, dtype=np.int64)
        positions = np.zeros(s, dtype=np.int64)
        at = 0
        for k, (doc, start, length) in enumerate(pieces):
            lo, hi = int(store.offsets[doc]), int(store.offsets[doc + 1])
            a = lo + start
            inputs[at:at + length] = store.tokens[a:a + length]
            n_next = min(length, hi - a - 1)  # targets that exist inside the document
            targets = np.asarray(store.tokens[a + 1:a + 1 + n_next], dtype=np.int64)
            if store.mask is not None and not self.include_prompt:
                targets = np.where(store.mask[a + 1:a + 1 + n_next] == 1, targets, IGNORE_INDEX)
            labels[at:at + n_next] = targets
            docs[at:at + length] = k
            positions[at:at + length] = np.arange(length)
            at += length
        positions[at:] = np.arange(s - at)
        return {"input": torch.from_numpy(inputs), "labels": torch.from_numpy(labels),
                "document_ids": torch.from_numpy(docs), "positions": torch.from_numpy(positions),
                "truncated": torch.tensor(truncated)}


def _kept(store: TokenStore, min_tokens: int) -> np.ndarray | None:
    """Indices of documents with at least ``min_tokens`` tokens; None when every one is kept."""
    if min_tokens <= 1:
        return None
    return np.nonzero(store.lengths() >= min_tokens)[0]


class StreamWindows(WindowDataset):
    def __init__(self, store, seq_len, seed, shuffle, pad_id, min_document_tokens: int = 0):
        super().__init__(store, seq_len, seed, shuffle, pad_id)
        self.kept = _kept(store, min_document_tokens)
        if self.kept is None:
            self.cum = store.offsets
        else:
            self.cum = np.zeros(len(self.kept) + 1, dtype=np.int64)
            np.cumsum(store.lengths()[self.kept], out=self.cum[1:])
            self.stats["skipped_short"] = store.n_docs - len(self.kept)
        self.n_windows = int(self.cum[-1]) // seq_len
        self.stats["windows"] = self.n_windows

    def pieces(self, window):
        start, end = window * self.seq_len, (window + 1) * self.seq_len
        k = int(np.searchsorted(self.cum, start, side="right")) - 1
        out = []
        while start < end:
            doc_start, doc_end = int(self.cum[k]), int(self.cum[k + 1])
            take = min(end, doc_end) - start
            if take > 0:
                doc = k if self.kept is None else int(self.kept[k])
                out.append((doc, start - doc_start, take))
                start += take
            k += 1
        return out, 0


class DocumentWindows(WindowDataset):
    """One document per window; longer ones keep their first ``seq_len`` tokens (``truncated``)."""

    packed = False

    def __init__(self, store, seq_len, seed, shuffle, pad_id, min_document_tokens: int = 0,
                 include_prompt: bool = True, docs: np.ndarray | None = None):
        super().__init__(store, seq_len, seed, shuffle, pad_id, include_prompt)
        kept = _kept(store, min_document_tokens)
        self.docs = docs if docs is not None else (np.arange(store.n_docs) if kept is None else kept)
        self.n_windows = len(self.docs)
        lengths = store.lengths()[self.docs]
        self.stats.update(windows=self.n_windows, truncated=int((lengths > seq_len).sum()))
        if kept is not None:
            self.stats["skipped_short"] = store.n_docs - len(kept)

    def pieces(self, window):
        doc = int(self.docs[window])
        length = int(self.store.offsets[doc + 1] - self.store.offsets[doc])
        return [(doc, 0, min(length, self.seq_len))], int(length > self.seq_len)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of sample indices, each summing to at most ``capacity`` (longest samples placed first)."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin), sorted
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, b = free.pop(k)
            bins[b].append(int(i))
        else:
            room, b = capacity, len(bins)
            bins.append([int(i)])
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


class PackedSamples(WindowDataset):
    """Whole samples (truncated to ``seq_len`` where allowed) packed into windows."""

    def __init__(self, store, seq_len, seed, shuffle, pad_id, include_prompt: bool, docs: np.ndarray):
        super().__init__(store, seq_len, seed, shuffle, pad_id, include_prompt)
        lengths = store.lengths()[docs]
        self.truncated_docs = set(docs[lengths > seq_len].tolist())
        bins = best_fit_decreasing(np.minimum(lengths, seq_len), seq_len)
        self.members = [sorted(int(docs[i]) for i in b) for b in bins]
        self.n_windows = len(bins)
        self.stats.update(windows=self.n_windows, truncated=len(self.truncated_docs), samples=len(docs))

    def pieces(self, window):
        out, truncated = [], 0
        for doc in self.members[window]:
            length = int(self.store.offsets[doc + 1] - self.store.offsets[doc])
            out.append((doc, 0, min(length, self.seq_len)))
            truncated += doc in self.truncated_docs
        return out, truncated
