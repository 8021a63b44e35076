"""The ``[training.hf_dataset]`` table: training rows from the `datasets` library (its own file,
so that job_config.py stays under 400 lines; re-exported from there)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HFDataset:
    """[training.hf_dataset]: the training rows from the `datasets` library instead of local files."""

    name: str = ""
    """A `datasets` name (org/name, from the Hub or its cache) or a local folder (one that
    Dataset.save_to_disk wrote, or data files load_dataset reads); "" = off. Short form:
    training.dataset_path = "hf:NAME" (validation.dataset_path too, "hf:NAME:SPLIT" for a split)."""
    config: str = ""
    """The dataset's configuration (subset); "" = its default."""
    split: str = "train"
    """The split whose rows are read, in their order."""
    column: str = ""
    """The field holding each row's text (dataset "text") or messages (dataset "sft"); "" = the
    rows' own fields, as in a .jsonl file ("text"; "messages" or "prompt" / "completion")."""
    streaming: bool = False
    """Refused: the token store tokenizes every row once before the first step, so that every
    layout reads the same global order; a streamed split has no length to cut into work items."""
