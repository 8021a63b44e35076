"""What a checkpoint says of its model, read without a process group: the record (``model_args.json``, and
``hf_assets/`` for runs started from a Hugging Face folder), its data settings, and its model weights.

The contract the two exports share (``hf_export``: the merged model; ``peft_export``: the adapters) and the run
spec reads: both import it from here, neither from the other (they imported each other, issue 46).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ulysses.interop.hf_check import weights_dtype
from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.registry import get_family

RECORD = "model_args.json"
ASSETS = "hf_assets"
# the files of a Hugging Face folder that are not weights and that an export carries over
ASSET_SUFFIXES = (".json", ".model", ".txt", ".jinja", ".tiktoken")
_RUNTIME_FIELDS = ("attn_backend", "sdpa_backends", "mlp_tile_size", "loss_backend", "loss_chunk_size")  # how it ran, not what it is


# -- the record ------------------------------------------------------------------------------


def write_model_record(step_dir: str, args: DecoderArgs, hf_assets_path: str = "", seq_len: int = 0) -> None:
    """Write ``model_args.json`` (and ``hf_assets/`` when the run came from a Hugging Face folder) into a checkpoint.

    ``seq_len``: the length the run trains at; export raises ``max_position_embeddings`` to it.
    """
    record = {"args": {k: v for k, v in dataclasses.asdict(args).items() if k not in _RUNTIME_FIELDS}}
    if seq_len:
        record["seq_len"] = seq_len
    if hf_assets_path:
        dtype = _source_weights_dtype(hf_assets_path)
        if dtype:
            record["weights_dtype"] = dtype
        os.makedirs(os.path.join(step_dir, ASSETS), exist_ok=True)
        for name in sorted(os.listdir(hf_assets_path)):
            src = os.path.join(hf_assets_path, name)
            if os.path.isfile(src) and name.endswith(ASSET_SUFFIXES) and not name.endswith(".index.json"):
                shutil.copyfile(src, os.path.join(step_dir, ASSETS, name))
        with open(os.path.join(hf_assets_path, "config.json")) as f:
            record["hf_config"] = json.load(f)
    with open(os.path.join(step_dir, RECORD), "w") as f:
        json.dump(record, f, indent=2)


def _source_weights_dtype(hf_assets_path: str) -> str | None:
    """The dtype of the source folder's safetensors (its headers); for a start checkpoint's ``hf_assets/``
    (context extension), the one that checkpoint recorded; None when neither says."""
    dtype = weights_dtype(hf_assets_path)
    folder = os.path.normpath(hf_assets_path)
    if dtype is None and os.path.basename(folder) == ASSETS:
        dtype = (_read_record(os.path.dirname(folder)) or {}).get("weights_dtype")
    return dtype


def _read_record(step_dir: str) -> dict | None:
    path = os.path.join(step_dir, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def recorded_seq_len(step_dir: str) -> int:
    """The training length a checkpoint's record names (0: none recorded)."""
    return int((_read_record(step_dir) or {}).get("seq_len", 0))


def read_model_record(step_dir: str) -> tuple[DecoderArgs, dict | None] | None:
    """(args, source config.json or None) recorded in a checkpoint; None for checkpoints without a record."""
    record = _read_record(step_dir)
    if record is None:
        return None
    fields = {k: v for k, v in record["args"].items() if k not in _RUNTIME_FIELDS}  # older records kept them
    for key in ("rope_scaling", "local_rope_scaling"):
        if fields.get(key) is not None:
            fields[key] = RopeScaling(**fields[key])
    if fields.get("moe") is not None:
        fields["moe"] = MoEArgs(**fields["moe"])
    return get_family(fields.get("family", "llama")).args_class(**fields), record.get("hf_config")


def read_data_settings(checkpoint_dir: str) -> dict | None:
    """The data settings a checkpoint was trained with (seq_len, dataset, tokenizer, ...), None when unrecorded."""
    key = "dataloader.dataset_state.data_settings"
    if key not in FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata:
        return None
    state = {"dataloader": {"dataset_state": {"data_settings": ""}}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint_dir, no_dist=True)
    return json.loads(state["dataloader"]["dataset_state"]["data_settings"])


# -- the model weights ----------------------------------------------------------------------


def model_metadata(checkpoint_dir: str) -> dict[str, TensorStorageMetadata]:
    """The model's tensors in a checkpoint's ``.metadata`` (name without ``model.`` -> metadata); refuses none."""
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    model = {
        key[len("model."):]: meta for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{checkpoint_dir!r} holds no model weights")
    return model


def read_model_weights(checkpoint_dir: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a checkpoint (all, or ``names``), read without a process group."""
    metadata = model_metadata(checkpoint_dir)
    model = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
             if names is None or k in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=checkpoint_dir, no_dist=True)
    return model
