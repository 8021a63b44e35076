"""Local corpus files -> ordered work items -> rows, read piece by piece (never a whole corpus).

A corpus is a ``.txt`` / ``.jsonl`` / ``.parquet`` file or a folder of them (sorted by
name). It is cut into *work items* in a fixed order, so any number of workers (ranks of a
node, or processes of ``scripts/prepare_data.py``) can tokenize disjoint items and the
concatenation of their outputs in item order does not depend on how many there were:

* ``.jsonl``: byte ranges of about ``JSONL_CHUNK_BYTES``; an item holds the lines that
  *start* inside its range (a line is read by exactly one item);
* ``.parquet``: one item per row group;
* ``.txt``: the whole file is one document (one item).

Every row comes with its place (file, line or row) so that a bad row can be named.
"""

from __future__ import annotations

import glob
import json
import os

from titan_ulysses.data.work import DataError, WorkItem, kind_of
from titan_ulysses.interop.hf_datasets import read_hf_rows

JSONL_CHUNK_BYTES = 16 * 2**20
EXTENSIONS = ("txt", "jsonl", "parquet")


def list_files(path: str, key: str = "training.dataset_path") -> list[str]:
    """The corpus files of ``path`` (a file, or a folder's .txt/.jsonl/.parquet files by name)."""
    if not path or not os.path.exists(path):
        raise DataError(f"{key} {path!r} does not exist (a .txt/.jsonl/.parquet file or a folder of them)")
    if os.path.isdir(path):
        files = sorted(f for ext in EXTENSIONS for f in glob.glob(os.path.join(path, f"*.{ext}")))
        if not files:
            raise DataError(f"{key} {path!r} is a folder without any .txt, .jsonl or .parquet file")
        return files
    if not path.endswith(tuple(f".{e}" for e in EXTENSIONS)):
        raise DataError(f"{key} {path!r} is not a .txt, .jsonl or .parquet file")
    return [path]


def work_items(files: list[str]) -> list[WorkItem]:
    items = []
    for f in files:
        kind = f.rsplit(".", 1)[1]
        if kind == "jsonl":
            size = os.path.getsize(f)
            for start in range(0, max(size, 1), JSONL_CHUNK_BYTES):
                items.append(WorkItem(f, kind, start, min(start + JSONL_CHUNK_BYTES, size)))
        elif kind == "parquet":
            for group in range(_parquet_file(f).num_row_groups):
                items.append(WorkItem(f, kind, group, group + 1))
        else:
            items.append(WorkItem(f, kind))
    return items


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from e


def _line_number(path: str, offset: int) -> int:
    """1-based number of the line that starts at byte ``offset`` (only computed for errors)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def read_rows(item: WorkItem):
    """Yield ``(where, row)`` for the rows of ``item``: ``row`` is a dict (jsonl/parquet/hf) or a str (txt)."""
    if item.kind == "hf":  # a `datasets` split's row range (hf_datasets.py)
        yield from read_hf_rows(item)
        return
    if item.kind == "txt":
        with open(item.path, "rb") as f:
            data = f.read()
        nul = data.find(b"\0")  # valid UTF-8, but no text holds it: a binary file (an all-NUL one trained)
        if nul >= 0:
            raise DataError(f"{item.path}: not text (a NUL byte at byte {nul}: a binary file?); name .txt files "
                            f"of UTF-8 text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{item.path}: not UTF-8 text (byte {e.start}); re-encode it as UTF-8") from e
        if text.strip():  # an empty file is no document (not one of only BOS and EOS)
            yield item.path, text
        return
    if item.kind == "parquet":
        table = _parquet_file(item.path).read_row_group(item.start)
        first = sum(_parquet_file(item.path).metadata.row_group(g).num_rows for g in range(item.start))
        for i, row in enumerate(table.to_pylist()):
            yield f"{item.path} row {first + i + 1}", row
        return
    with open(item.path, "rb") as f:
        f.seek(item.start)
        if item.start > 0:
            f.seek(item.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # this line started in the previous item
        while f.tell() < item.end:
            offset = f.tell()
            raw = f.readline()
            if not raw:
                break
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                line = _line_number(item.path, offset)
                raise DataError(f"{item.path} line {line}: not UTF-8 text; re-encode the file as UTF-8") from e
            except json.JSONDecodeError as e:
                line = _line_number(item.path, offset)
                raise DataError(f"{item.path} line {line}: not a JSON object ({e.msg})") from e
            if not isinstance(row, dict):
                line = _line_number(item.path, offset)
                raise DataError(f"{item.path} line {line}: a JSON object is expected, got {type(row).__name__}")
            yield _Where(item.path, offset), row


class _Where:
    """A jsonl row's place; the line number is counted only when a message needs it."""

    __slots__ = ("path", "offset")

    def __init__(self, path: str, offset: int):
        self.path, self.offset = path, offset

    def __str__(self) -> str:
        return f"{self.path} line {_line_number(self.path, self.offset)}"


def text_field(where, row, field: str = "text") -> str:
    """``row[field]`` as a string, or a DataError naming the file, the line and the field."""
    if isinstance(row, str):
        return row
    value = row.get(field)
    if not isinstance(value, str):
        found = "missing" if field not in row else kind_of(value)
        sft = field not in row and (isinstance(row.get("messages"), list) or {"prompt", "completion"} <= set(row))
        hint = "; these are SFT rows: set the dataset of this file (training. or validation.dataset) to 'sft'" \
            if sft else ""
        raise DataError(f"{where}: field {field!r} is {found}; every row needs a string {field!r} "
                        f"(fields found: {sorted(row)}){hint}")
    return value
