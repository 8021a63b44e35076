"""What a source of rows hands the token store, and how bad data is refused: the contract between
``data/sources.py`` (local files) and ``interop/hf_datasets.py`` (a `datasets` split), which both import it
(neither imports the other back)."""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """The data (not the code) is wrong: one line naming the file and what to fix."""


@dataclass(frozen=True)
class WorkItem:
    path: str
    """The file (or an ``hf:`` dataset path) the item reads."""
    kind: str
    """"txt", "jsonl", "parquet" or "hf" (``path``: an hf: dataset path)."""
    start: int = 0
    """jsonl: the byte range ``[start, end)``; parquet: the row group index; hf: the row range."""
    end: int = 0
    """The end of that range (exclusive)."""


def kind_of(value) -> str:
    """How a row's value is named in a refusal: JSON's ``null``, else the Python type (``a list``)."""
    return "null" if value is None else f"a {type(value).__name__}"
