"""The data side of a run, from the config: datasets, the stateful loader, validation batches.

``build_data`` is to data what ``parallelize_decoder`` is to the model: the trainer calls it
once and gets back a ``Data`` holding the training loader (whose state is the global sample
index, plus the data settings that a resume checks), whether rows pack several documents
(so attention needs the document mask), and a factory for the held-out batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np

from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.interop import hf_datasets
from titan_ulysses.data.chat import load_chat_template
from titan_ulysses.data.datasets import PasskeyDataset
from titan_ulysses.data.encode import SFTEncoder, TextEncoder
from titan_ulysses.interop.hf_datasets import is_hf, training_dataset_path
from titan_ulysses.data.loader import build_dataloader
from titan_ulysses.data.sources import DataError, list_files, work_items
from titan_ulysses.data.token_store import (
    build_or_open,
    build_with_processes,
    cache_key,
    default_cache_dir,
    tokenizer_identity,
)
from titan_ulysses.data.tokenizer import tokenizer_kind
from titan_ulysses.data.windows import DocumentWindows, PackedSamples, StreamWindows

VALIDATION_SEED_OFFSET = 1_000_003  # passkey validation draws other keys than training


def node_group():
    """(group, rank in it, size) of the ranks on this host, which share a token-store build.

    Every rank must call this (group creation is collective); None-group when single.
    """
    import socket

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None, 0, 1
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    mine = None
    for host in dict.fromkeys(hosts):  # every rank creates every group, in the same order
        ranks = [r for r, h in enumerate(hosts) if h == host]
        group = dist.new_group(ranks, backend="gloo", timeout=timedelta(hours=4))
        if host == hosts[dist.get_rank()]:
            mine = (group, ranks.index(dist.get_rank()), len(ranks))
    return mine


def check_dataset_files(config: JobConfig) -> None:
    """The corpus files the settings name exist (a DataError naming the setting otherwise). Cheap:
    run first, so a missing file is not hidden behind a layout error of the same launch."""
    t, v = config.training, config.validation
    path = training_dataset_path(t)
    if t.dataset != "passkey" and path:
        check_corpus(path, "training.hf_dataset" if t.hf_dataset.name else "training.dataset_path")
    if v.enable and (v.dataset or t.dataset) != "passkey" and v.dataset_path:
        check_corpus(v.dataset_path, "validation.dataset_path")


def check_corpus(path: str, key: str) -> None:
    """A corpus path exists: its files, or a `datasets` split that loads (downloaded unless offline)."""
    if is_hf(path):
        hf_datasets.open_dataset(path, key)
    else:
        list_files(path, key)


def open_store(kind: str, path: str, tokenizer, config: JobConfig, group=None, rank: int = 0, world: int = 1,
               processes: int = 0):
    """Tokenize ``path`` once (in parallel over the ranks of ``group``, or over ``processes``
    forked workers when there is no group) and map the result."""
    t = config.training
    key_name = "training.dataset_path" if path == t.dataset_path else (
        "training.hf_dataset" if path == training_dataset_path(t) else "validation.dataset_path")
    options: dict = {"kind": kind}
    if kind == "sft":
        template = load_chat_template(t.chat_template, tokenizer)
        encode = SFTEncoder(tokenizer, template)
        options["chat_template"] = template.source
        options["chat_special_tokens"] = template.special_tokens
    else:
        encode = TextEncoder(tokenizer)
    ident = tokenizer_identity(tokenizer)
    if is_hf(path):  # a `datasets` split: row ranges, keyed by its fingerprint
        items, source = hf_datasets.hf_items(path, key_name)
        key = cache_key([], ident, {**options, "hf": source})
        cache_dir = t.dataset_cache_dir or hf_datasets.cache_dir(path, key_name)
        meta = {"hf": source, "tokenizer": ident, "kind": kind}
    else:
        files = list_files(path, key_name)
        items, key = work_items(files), cache_key(files, ident, options)
        cache_dir = t.dataset_cache_dir or default_cache_dir(path)
        meta = {"files": files, "tokenizer": ident, "kind": kind}
    if processes > 1 and world == 1:
        store = build_with_processes(items, encode, cache_dir, key, tokenizer.vocab_size, meta, processes)
    else:
        store = build_or_open(items, encode, cache_dir, key, tokenizer.vocab_size, meta, rank, world, group)
    if store.n_docs == 0:
        raise DataError(f"{key_name} {path!r} holds no documents (empty file?)")
    return store


def fewer_than_one_window(path: str, n_tokens: int, training) -> str:
    """The refusal of a text corpus that fills no window (at launch, and in the dry run's read of it)."""
    return (f"{path!r} holds {n_tokens} tokens in documents of at least training.min_document_tokens = "
            f"{training.min_document_tokens}: fewer than one window of training.seq_len = {training.seq_len}")


def build_dataset(kind: str, path: str, tokenizer, config: JobConfig, seed: int, group=None, rank=0, world=1):
    t = config.training
    if kind == "passkey":
        return PasskeyDataset(tokenizer, t.seq_len, seed, t.passkey_digits)
    store = open_store(kind, path, tokenizer, config, group, rank, world)
    pad = tokenizer.pad_id
    if kind == "text":
        cls = StreamWindows if t.packing else DocumentWindows
        ds = cls(store, t.seq_len, seed, t.shuffle, pad, t.min_document_tokens)
        if len(ds) == 0:
            raise DataError(fewer_than_one_window(path, store.n_tokens, t))
        return ds
    lengths = store.lengths()
    docs = np.arange(store.n_docs)
    if t.min_document_tokens > 1:
        docs = docs[lengths >= t.min_document_tokens]
    long = docs[lengths[docs] > t.seq_len]
    dropped = 0
    if len(long) and t.overlong_samples == "error":
        raise DataError(f"{len(long)} of {len(docs)} SFT samples in {path!r} are longer than training.seq_len "
                        f"{t.seq_len} (the longest has {int(lengths[long].max())} tokens, sample #{int(long[0])} "
                        f"in file order); set training.overlong_samples to 'truncate' or 'drop'")
    if t.overlong_samples == "drop":
        docs, dropped = docs[lengths[docs] <= t.seq_len], len(long)
    if len(docs) == 0:
        raise DataError(f"no SFT sample of {path!r} is left (dropped {dropped} longer than training.seq_len)")
    _check_truncated_keep_loss(store, docs, t.seq_len, path, t.include_prompt_loss)
    if t.packing:
        ds = PackedSamples(store, t.seq_len, seed, t.shuffle, pad, t.include_prompt_loss, docs)
    else:
        ds = DocumentWindows(store, t.seq_len, seed, t.shuffle, pad, include_prompt=t.include_prompt_loss, docs=docs)
    ds.stats["dropped"] = dropped
    ds.stats["skipped_short"] = store.n_docs - len(docs) - dropped
    return ds


def _check_truncated_keep_loss(store, docs: np.ndarray, seq_len: int, path: str, include_prompt: bool) -> None:
    """A sample truncated to ``seq_len`` must keep a token with loss (else its rows have no
    loss at all: a data problem, not a NaN to find later)."""
    if store.mask is None or include_prompt:
        return
    lengths = store.lengths()
    bad = [int(d) for d in docs[lengths[docs] > seq_len]
           if not np.asarray(store.mask[int(store.offsets[d]) + 1:int(store.offsets[d]) + 1 + seq_len]).any()]
    if bad:  # mask[lo+1 : lo+1+seq_len] are the labels a truncated window keeps
        raise DataError(f"{len(bad)} SFT sample(s) of {path!r} keep no completion token once truncated to "
                        f"training.seq_len {seq_len} (first: sample #{bad[0]} in file order, {int(lengths[bad[0]])} "
                        f"tokens): they would train on nothing; set training.overlong_samples 'drop', raise "
                        f"training.seq_len, or shorten those prompts")


def corpus_fingerprint(path: str, key: str = "training.dataset_path") -> str:
    """The content of the corpus files, cheaply: names, sizes and a hash of each file's first and last MiB."""
    import hashlib

    from titan_ulysses.data.sources import list_files

    h = hashlib.sha256()
    if is_hf(path):  # the datasets library's fingerprint of the split's content
        h.update(repr(sorted(hf_datasets.hf_items(path, key)[1].items())).encode())
        return h.hexdigest()[:20]
    for f in list_files(path, key):
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(2**20))
            if size > 2**20:
                fh.seek(max(size - 2**20, 2**20))
                h.update(fh.read())
    return h.hexdigest()[:20]


def data_settings(config: JobConfig, tokenizer=None) -> dict:
    """What decides which tokens a global sample index means; a resume checks it.

    With ``tokenizer``, its content fingerprint (not the path it was read from) and the
    corpus' fingerprint (``corpus_fingerprint``) are part of it: rows appended to the corpus
    or another tokenizer.json at the same path are a change like any other."""
    t, m = config.training, config.model
    settings = {"dataset": t.dataset, "seq_len": t.seq_len, "seed": t.seed, "tokenizer": tokenizer_kind(m)}
    if tokenizer is not None:
        settings["tokenizer_content"] = tokenizer.fingerprint
    elif m.tokenizer_path:
        settings["tokenizer_path"] = os.path.abspath(m.tokenizer_path)
    if t.dataset == "passkey":
        settings["passkey_digits"] = t.passkey_digits
    else:
        path = training_dataset_path(t)
        settings.update(dataset_path=path if is_hf(path) else os.path.abspath(path), packing=t.packing,
                        shuffle=t.shuffle, min_document_tokens=t.min_document_tokens)
        if tokenizer is not None:
            settings["dataset_content"] = corpus_fingerprint(path)
    if t.dataset == "sft":
        settings.update(overlong_samples=t.overlong_samples, include_prompt_loss=t.include_prompt_loss,
                        chat_template=t.chat_template)
    return settings


@dataclass
class Data:
    dataloader: object
    dataset: object
    packed: bool
    """Rows may hold several documents: attention must mask per document."""
    validation: object | None = None
    """The held-out dataset, or None."""
    stats: dict = field(default_factory=dict)
    global_batch_size: int = 0
    local_batch_size: int = 0
    dp_rank: int = 0
    dp_size: int = 1

    def validation_loader(self):
        """A fresh loader over the held-out set from its first sample: every evaluation sees the same batches."""
        return build_dataloader(self.validation, global_batch_size=self.global_batch_size,
                                local_batch_size=self.local_batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size)


def build_data(config: JobConfig, tokenizer, dp_rank: int, dp_size: int, global_batch_size: int,
               fake: bool = False, verbose: bool = True) -> Data:
    """Datasets and loader of a run; collective when the job has several ranks (the corpus build)."""
    t, v = config.training, config.validation
    needs_store = t.dataset != "passkey" or (v.enable and (v.dataset or t.dataset) != "passkey")
    group, rank, world = node_group() if needs_store and not fake else (None, 0, 1)
    path = training_dataset_path(t)  # dataset_path, or [training.hf_dataset] as an hf: path
    dataset = build_dataset(t.dataset, path, tokenizer, config, t.seed, group, rank, world)
    dataloader = build_dataloader(
        dataset, global_batch_size=global_batch_size, local_batch_size=t.local_batch_size,
        dp_rank=dp_rank, dp_size=dp_size, settings=data_settings(config, tokenizer),
        allow_change=config.checkpoint.allow_data_change,
    )
    validation = None
    if v.enable:
        kind = v.dataset or t.dataset
        validation = build_dataset(kind, v.dataset_path, tokenizer, config, t.seed + VALIDATION_SEED_OFFSET,
                                   group, rank, world)
    stats = dict(getattr(dataset, "stats", {}))
    if verbose and stats and rank == 0 and (group is None or _global_rank() == 0):
        print(f"data: {t.dataset} {path}: " + ", ".join(f"{k} {v_}" for k, v_ in stats.items()), flush=True)
    return Data(dataloader, dataset, packed=getattr(dataset, "packed", False), validation=validation,
                stats=stats, global_batch_size=global_batch_size, local_batch_size=t.local_batch_size,
                dp_rank=dp_rank, dp_size=dp_size)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
