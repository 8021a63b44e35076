"""A tokenized corpus on disk: memory-mapped tokens, document offsets and (SFT) loss masks.

Built once per (files, their sizes and mtimes, tokenizer, rendering options) and reused by
every later run and layout; a run only maps the files, so memory stays bounded whatever
the corpus size. Why NumPy ``memmap`` rather than Hugging Face ``datasets``/Arrow: the
store is three flat arrays that any process maps in microseconds, with no schema, no
second copy of the text and no extra dependency; the readers (``windows.py``) need
random access by token offset, which a flat array gives directly.

Layout of ``{cache_dir}/{key}/``::

    tokens.bin    uint16 (vocabularies up to 65536 ids) or uint32, all documents back to back
    offsets.npy   int64 [n_docs + 1], document d is tokens[offsets[d]:offsets[d+1]]
    mask.bin      uint8, 1 where a token carries loss (SFT only: completion/assistant tokens)
    meta.json     written last; a folder without it is never used

Building: one builder per key at a time holds ``{key}.lock`` (``build_lock.py``; other jobs
building the same key wait, then open the store). The corpus is cut into ordered work
items (``sources.py``); worker ``w`` of ``n`` tokenizes items ``w, w+n, ...`` into
``{key}.parts-{host}-{cut}/part-XXXXXX.npz`` (each written under a temporary name and
renamed, so a killed build leaves only whole parts, which the next build reuses). Worker 0
then concatenates the parts in item order into ``{key}.tmp-{host}-{pid}/`` and renames that
folder to ``{key}``: the store appears whole or not at all. A build that fails (a bad row,
a full disk) removes its parts and temporary folder; the next builder removes what killed
ones left.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time

import numpy as np

from titan_ulysses.data.build_lock import BuildLock, folder_bytes, remove_litter, write_error
from titan_ulysses.data.sources import DataError, WorkItem, read_rows

STORE_VERSION = 1


def _stat(path: str) -> list:
    st = os.stat(path)
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def tokenizer_identity(tokenizer, path: str = "") -> dict:
    """What makes two tokenizers produce the same ids: class, vocabulary, specials and the
    content of their file (``tokenizer.fingerprint``), never the path it was read from."""
    return {"class": type(tokenizer).__name__, "vocab_size": int(tokenizer.vocab_size),
            "bos": getattr(tokenizer, "bos_id", None), "eos": getattr(tokenizer, "eos_id", None),
            "content": getattr(tokenizer, "fingerprint", None)}


def cache_key(files: list[str], tokenizer_id: dict, options: dict) -> str:
    """A hash of the files (paths, sizes, mtimes), the tokenizer and the rendering options."""
    blob = json.dumps({"version": STORE_VERSION, "files": [_stat(f) for f in files],
                       "tokenizer": tokenizer_id, "options": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def default_cache_dir(dataset_path: str) -> str:
    """``.titan_cache`` inside the corpus folder, or beside a single corpus file."""
    base = dataset_path if os.path.isdir(dataset_path) else os.path.dirname(os.path.abspath(dataset_path))
    return os.path.join(base, ".titan_cache")


class TokenStore:
    """Read-only view of a built store; arrays are memory-mapped (nothing is read up front)."""

    def __init__(self, folder: str):
        with open(os.path.join(folder, "meta.json")) as f:
            self.meta = json.load(f)
        self.folder = folder
        self.offsets = np.load(os.path.join(folder, "offsets.npy"), mmap_mode="r")
        n = int(self.offsets[-1])
        dtype = np.dtype(self.meta["dtype"])
        self.tokens = np.memmap(os.path.join(folder, "tokens.bin"), dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
        self.mask = None
        if self.meta["has_mask"]:
            self.mask = np.memmap(os.path.join(folder, "mask.bin"), dtype=np.uint8, mode="r", shape=(n,)) if n else np.zeros(0, np.uint8)

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def _parts_dir(final: str, items: list[WorkItem]) -> str:
    """Per host, and per cut of the corpus into items: parts are reusable only for the same cut."""
    cut = hashlib.sha256(repr([tuple(vars(i).values()) for i in items]).encode()).hexdigest()[:8]
    return f"{final}.parts-{socket.gethostname()}-{cut}"


def _part_path(parts_dir: str, index: int) -> str:
    return os.path.join(parts_dir, f"part-{index:06d}.npz")


def _write_atomic_npz(path: str, **arrays) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def tokenize_items(items: list[WorkItem], indices, encode, parts_dir: str, dtype, progress=None) -> None:
    """Tokenize ``items[i]`` for ``i in indices`` into part files (skipping parts already there).

    ``encode(where, row)`` returns ``(ids, mask or None)`` or None to skip the row.
    """
    os.makedirs(parts_dir, exist_ok=True)
    for i in indices:
        path = _part_path(parts_dir, i)
        if os.path.exists(path):
            continue
        ids, lengths, masks = [], [], []
        for where, row in read_rows(items[i]):
            out = encode(where, row)
            if out is None:
                continue
            doc, mask = out
            ids.append(np.asarray(doc, dtype=dtype))
            lengths.append(len(doc))
            if mask is not None:
                masks.append(np.asarray(mask, dtype=np.uint8))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
        arrays = {"tokens": cat(ids, dtype), "lengths": np.asarray(lengths, dtype=np.int64)}
        if masks:
            arrays["mask"] = cat(masks, np.uint8)
        _write_atomic_npz(path, **arrays)
        if progress is not None:
            progress(items[i], arrays["tokens"].size)


def merge_parts(n_items: int, parts_dir: str, final: str, dtype, meta: dict) -> None:
    """Concatenate the parts in item order into a temporary folder, then rename it to ``final``."""
    tmp = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _merge_into(tmp, n_items, parts_dir, dtype, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, final)  # atomic; fails if another builder renamed first
    except OSError:
        if not os.path.isfile(os.path.join(final, "meta.json")):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # someone else's identical store won the race
    shutil.rmtree(parts_dir, ignore_errors=True)


def _merge_into(tmp: str, n_items: int, parts_dir: str, dtype, meta: dict) -> None:
    os.makedirs(tmp)
    lengths, has_mask = [], False
    with open(os.path.join(tmp, "tokens.bin"), "wb") as tok_f, open(os.path.join(tmp, "mask.bin"), "wb") as mask_f:
        for i in range(n_items):
            with np.load(_part_path(parts_dir, i)) as part:
                tok_f.write(part["tokens"].astype(dtype, copy=False).tobytes())
                lengths.append(part["lengths"])
                if "mask" in part.files:
                    has_mask = True
                    mask_f.write(part["mask"].tobytes())
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(os.path.join(tmp, "offsets.npy"), offsets)
    if not has_mask:
        os.remove(os.path.join(tmp, "mask.bin"))
    meta = dict(meta, dtype=np.dtype(dtype).name, has_mask=has_mask, n_docs=len(lengths),
                n_tokens=int(offsets[-1]), built=time.strftime("%Y-%m-%d %H:%M:%S"))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def _item_bytes(item: WorkItem) -> int:
    if item.kind == "jsonl":
        return item.end - item.start
    return os.path.getsize(item.path) if item.kind == "txt" else 0


class Progress:
    """Rank 0's progress bar (tqdm) over the corpus bytes; its own share times the workers."""

    def __init__(self, items: list[WorkItem], workers: int, enabled: bool):
        self.workers, self.enabled = workers, enabled
        self.start = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=sum(_item_bytes(i) for i in items) or None, unit="B", unit_scale=True,
                            unit_divisor=1024, desc=f"tokenizing ({workers} worker(s))", mininterval=1.0,
                            dynamic_ncols=True)

    def __call__(self, item: WorkItem, n_tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(_item_bytes(item) * self.workers)  # an estimate: the other workers' pace is ours

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def estimate_bytes(items: list[WorkItem], parts_dir: str) -> int:
    """Space a build needs: the parts written so far scaled to the whole corpus, twice (parts and store)."""
    total = sum(_item_bytes(i) for i in items) or 1
    done = [i for k, i in enumerate(items) if os.path.exists(_part_path(parts_dir, k))]
    written = folder_bytes(parts_dir) if os.path.isdir(parts_dir) else 0
    per_byte = written / max(sum(_item_bytes(i) for i in done), 1) if done else 2.0  # at worst 1 uint16 per byte
    return int(2 * per_byte * total)


_FORKED: tuple = ()  # (items, encode, parts_dir, dtype) inherited by forked workers


def _forked_worker(args) -> str | None:
    worker, workers = args
    items, encode, parts_dir, dtype = _FORKED
    progress = Progress(items, workers, worker == 0)
    try:
        tokenize_items(items, range(worker, len(items), workers), encode, parts_dir, dtype, progress)
    except DataError as e:
        return str(e)
    except OSError as e:
        return write_error(e, parts_dir, estimate_bytes(items, parts_dir))
    finally:
        progress.close()
    return None


def build_with_processes(items: list[WorkItem], encode, cache_dir: str, key: str, vocab_size: int, meta: dict,
                         workers: int) -> TokenStore:
    """The store for ``key``, built if absent by ``workers`` forked processes (one machine, no process group)."""
    import multiprocessing as mp

    global _FORKED
    final = os.path.join(cache_dir, key)
    if _ready(final):
        return TokenStore(final)
    lock, parts_dir = _start_build(cache_dir, key, items, final)
    dtype = token_dtype(vocab_size)
    if lock is None:
        return TokenStore(final)
    state = "interrupted"
    try:
        _FORKED = (items, encode, parts_dir, dtype)
        with mp.get_context("fork").Pool(workers) as pool:
            errors = pool.map(_forked_worker, [(w, workers) for w in range(workers)])
        _FORKED = ()
        state = "failed"
        _raise_first(errors)
        _raise_first([_merge(items, parts_dir, final, dtype, meta)])
        state = "built"
    finally:
        _finish_build(lock, state, parts_dir, final)
    return TokenStore(final)


def _ready(final: str) -> bool:
    return os.path.isfile(os.path.join(final, "meta.json"))


def _say(message: str) -> None:
    print(message, flush=True)


def _start_build(cache_dir: str, key: str, items: list[WorkItem], final: str):
    """(lock, parts folder) for the one builder of ``key``; lock None if the store appeared while we waited."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = BuildLock(final).acquire(_say)
    except OSError as e:
        raise DataError(write_error(e, final, 0)) from e
    if _ready(final):  # another job built it while we waited
        lock.release(built=True)
        return None, ""
    parts_dir = _parts_dir(final, items)
    remove_litter(cache_dir, key, keep=parts_dir)
    return lock, parts_dir


def _merge(items, parts_dir: str, final: str, dtype, meta: dict) -> str | None:
    try:
        merge_parts(len(items), parts_dir, final, dtype, meta)
    except OSError as e:
        return write_error(e, final, folder_bytes(parts_dir))
    return None


def _finish_build(lock: BuildLock, state: str, parts_dir: str, final: str) -> None:
    """Release the key. A failed build (a bad row, a full disk) leaves no parts and no temporary
    folder behind; an interrupted one (SIGTERM, Ctrl-C) keeps its whole parts for the next build."""
    if state == "failed":
        shutil.rmtree(parts_dir, ignore_errors=True)
    shutil.rmtree(f"{final}.tmp-{socket.gethostname()}-{os.getpid()}", ignore_errors=True)
    lock.release(built=state == "built")


def build_or_open(items: list[WorkItem], encode, cache_dir: str, key: str, vocab_size: int, meta: dict,
                  rank: int = 0, world: int = 1, group=None) -> TokenStore:
    """The store for ``key``, built if absent by the ``world`` ranks of ``group`` together.

    Every rank of ``group`` must call this. Rank 0 holds the key's build lock (waiting for
    another job building the same key). Errors on any rank (a bad row, a full disk) reach
    all of them as the same DataError, so no rank waits forever for a peer that failed.
    """
    import torch.distributed as dist

    final = os.path.join(cache_dir, key)
    lock, error, ready = None, None, _ready(final)
    if rank == 0 and not ready:
        try:
            lock, _ = _start_build(cache_dir, key, items, final)
            ready = lock is None
        except DataError as e:
            error = str(e)
    if world > 1:  # agree on rank 0's view, which a concurrent builder could change under us
        flag = [(ready, error)]
        dist.broadcast_object_list(flag, src=dist.get_global_rank(group, 0), group=group)
        ready, error = flag[0]
    _raise_first([error])
    if ready:
        return TokenStore(final)
    dtype = token_dtype(vocab_size)
    parts_dir = _parts_dir(final, items)
    state = "interrupted"
    progress = Progress(items, world, rank == 0)
    try:
        error = None
        try:
            os.makedirs(parts_dir, exist_ok=True)
            tokenize_items(items, range(rank, len(items), world), encode, parts_dir, dtype, progress)
        except DataError as e:
            error = str(e)
        except OSError as e:
            error = write_error(e, parts_dir, estimate_bytes(items, parts_dir))
        progress.close()
        state = "failed"
        _raise_first(_gather(error, group) if world > 1 else [error])
        error = _merge(items, parts_dir, final, dtype, meta) if rank == 0 else None
        _raise_first(_gather(error, group) if world > 1 else [error])
        state = "built"
    finally:
        progress.close()
        if rank == 0:
            _finish_build(lock, state, parts_dir, final)
    if rank == 0:
        print(f"tokenized {len(items)} items in {time.perf_counter() - progress.start:.1f}s -> {final}", flush=True)
    return TokenStore(final)


def _gather(value, group):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_first(errors) -> None:
    first = next((e for e in errors if e), None)
    if first:
        raise DataError(first)
