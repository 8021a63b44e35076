"""Rows from the `datasets` library: ``training.dataset_path = "hf:org/name"`` or ``[training.hf_dataset]``.

A dataset path ``hf:NAME[?config=C&split=S&column=F]`` names a `datasets` dataset on the Hub (or in
its cache: ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` as `datasets` reads them) or a local folder
(one ``save_to_disk`` wrote, else data files ``load_dataset`` reads). Its split's rows, in their
order, are cut into work items of ``ROWS_PER_ITEM`` rows, so they go through the same token store and
global order as local files, and the same rows give the same tokens as a .jsonl of them.
The ``[training.hf_dataset]`` table is the same path spelled as settings (``training_dataset_path``).
Streaming is refused: the store tokenizes every row before the first step.
"""

from __future__ import annotations

import functools
import os
from urllib.parse import parse_qsl, urlencode

from titan_ulysses.data.work import DataError, WorkItem, kind_of

PREFIX = "hf:"
ROWS_PER_ITEM = 4096
OPTIONS = ("config", "split", "column")
_SAVED = ("dataset_info.json", "state.json", "dataset_dict.json")  # what Dataset(Dict).save_to_disk writes


def is_hf(path: str) -> bool:
    return bool(path) and path.startswith(PREFIX)


def training_dataset_path(training) -> str:
    """What the training data reads: ``training.dataset_path``, or the [training.hf_dataset] table as a path."""
    table = training.hf_dataset
    if not table.name:
        return training.dataset_path
    options = {k: v for k, v in (("config", table.config), ("split", table.split), ("column", table.column))
               if v and not (k == "split" and v == "train")}
    return PREFIX + table.name + (f"?{urlencode(options)}" if options else "")


def parse(path: str, key: str) -> tuple[str, dict]:
    """``hf:NAME?options`` -> (NAME, {config, split, column}); a DataError naming ``key`` when malformed."""
    name, _, query = path[len(PREFIX):].partition("?")
    options = dict(parse_qsl(query, keep_blank_values=True))
    if options.get("streaming", "false").lower() not in ("", "0", "false"):
        raise DataError(f"{key} {path!r}: streaming is not supported: the token store tokenizes every row once "
                        f"before the first step, so that every layout reads the same global order; drop streaming "
                        f"(the split is downloaded to the datasets cache)")
    options.pop("streaming", None)
    unknown = sorted(set(options) - set(OPTIONS))
    if not name or unknown:
        what = f"unknown option {unknown[0]!r}" if unknown else "no dataset name"
        raise DataError(f"{key} {path!r}: {what}; write hf:NAME or hf:NAME?config=C&split=S&column=F")
    return name, {"config": options.get("config", ""), "split": options.get("split", ""),  # "": the default
                  "column": options.get("column", "")}


def _saved(name: str) -> bool:
    return os.path.isdir(name) and any(os.path.isfile(os.path.join(name, f)) for f in _SAVED)


def split_of(name: str, options: dict) -> str:
    """The split the rows come from: the one asked for, else "train"; "" for a saved Dataset, which has none."""
    if _saved(name) and not os.path.isfile(os.path.join(name, "dataset_dict.json")):
        return ""
    return options["split"] or "train"


def _no_rows(folder: str) -> bool:
    """A local folder whose data files (not the datasets library's json records, not our caches) are all empty."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, dirs, files in os.walk(folder)
             for f in files if f not in _SAVED and not d[len(folder):].startswith(f"{os.sep}.")]
    return not any(sizes)


@functools.lru_cache(maxsize=8)
def open_dataset(path: str, key: str):
    """The split of ``path`` as a `datasets.Dataset` (memory-mapped Arrow; opened once per process)."""
    name, o = parse(path, key)
    try:
        import datasets
    except ImportError as e:
        raise DataError(f"{key} {path!r} needs the datasets library: pip install 'titan_ulysses[hub]' "
                        f"(or pip install datasets)") from e
    saved = _saved(name)
    try:
        if saved:
            if o["config"]:
                raise DataError(f"{key} {path!r}: a save_to_disk folder has no configurations; drop config")
            ds = datasets.load_from_disk(name)
            if isinstance(ds, datasets.DatasetDict):
                if (o["split"] or "train") not in ds:
                    raise DataError(f"{key} {path!r}: no split {o['split'] or 'train'!r} (splits: {sorted(ds)})")
                ds = ds[o["split"] or "train"]
            elif o["split"]:  # one Dataset: its rows would be read whatever split says
                raise DataError(f"{key} {path!r}: this save_to_disk folder holds one Dataset, without splits; "
                                f"drop split={o['split']}")
        else:
            ds = datasets.load_dataset(name, o["config"] or None, split=o["split"] or "train")
    except DataError:
        raise
    except Exception as e:  # not found, gated, offline and not cached, unknown split or config: one line
        if os.path.isdir(name) and _no_rows(name):  # the library fails on it with an IndexError or a StopIteration
            raise DataError(f"{key} {path!r}: an empty dataset: {name} holds no rows") from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if os.path.exists(name) else (
            " (offline: it must be in the datasets cache, HF_HOME; gated: `hf auth login` or HF_TOKEN)")
        raise DataError(f"{key} {path!r}: the datasets library cannot load it: {type(e).__name__}: {first}{hint}") from e
    if isinstance(ds, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise DataError(f"{key} {path!r}: an iterable (streamed) dataset; the token store needs a split of known length")
    if o["column"] and o["column"] not in ds.column_names:
        raise DataError(f"{key} {path!r}: no column {o['column']!r} (columns: {ds.column_names})")
    if len(ds) == 0:
        split = f"its split {split_of(name, o)}" if split_of(name, o) else "it"
        raise DataError(f"{key} {path!r}: an empty dataset: {split} holds no rows")
    return ds


def hf_items(path: str, key: str) -> tuple[list[WorkItem], dict]:
    """The work items of ``path`` (row ranges) and what identifies its content for the store's cache key."""
    ds = open_dataset(path, key)
    n = len(ds)
    items = [WorkItem(path, "hf", start, min(start + ROWS_PER_ITEM, n)) for start in range(0, n, ROWS_PER_ITEM)]
    identity = {"path": path, "rows": n, "fingerprint": ds._fingerprint, "columns": ds.column_names}
    return items, identity


def cache_dir(path: str, key: str) -> str:
    """Where the store of ``path`` goes: a .titan_cache in a local folder, else beside the datasets cache."""
    name, _ = parse(path, key)
    if os.path.isdir(name):
        return os.path.join(name, ".titan_cache")
    import datasets

    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), ".titan_cache")


def read_hf_rows(item: WorkItem, key: str = "training.dataset_path"):
    """Yield ``(where, row)`` for rows [start, end) of the split (``where`` names it: ``[test]``, or none for
    a Dataset without splits); with a column, the row is that field as ``{"text": ...}`` (a string) or
    ``{"messages": ...}`` (a list), and another value is refused naming the column."""
    name, o = parse(item.path, key)
    ds = open_dataset(item.path, key)
    batch = ds[item.start:item.end]
    columns = list(batch)
    column = o["column"]
    split = f" [{split_of(name, o)}]" if split_of(name, o) else ""
    for i in range(item.end - item.start):
        where = f"{name}{split} row {item.start + i + 1}"
        if column:
            value = batch[column][i]
            if not isinstance(value, (str, list)):
                raise DataError(f"{where}: column {column!r} is {kind_of(value)}; it must hold text (a string, "
                                f"for dataset 'text') or chat messages (a list, for 'sft'): set column to one that "
                                f"does (columns: {columns})")
            yield where, {"text" if isinstance(value, str) else "messages": value}
        else:
            yield where, {c: batch[c][i] for c in columns}
