"""A DCP checkpoint -> a Hugging Face model folder that ``transformers`` loads; and the record that makes it possible.

Every checkpoint holds ``model_args.json`` (the model arguments it was trained with and,
for runs started from a Hugging Face folder, that folder's ``config.json``) and, for those
runs, ``hf_assets/`` (copies of config.json and the tokenizer files). ``export_hf`` then
needs only the checkpoint: it writes ``config.json`` (the source one with the trained
shapes and RoPE settings written over it), the tokenizer files, and the weights as
``model.safetensors`` or, above ``max_shard_size``, as ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json``, as ``save_pretrained`` does. Weights are read one
output shard at a time, so host memory stays about one shard.
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

from titan_ulysses.interop.hf_adapter import (
    experts_to_theirs,
    hf_tensors,
    is_expert,
    join,
    our_shapes,
    ours_to_theirs,
    part_name,
)
from titan_ulysses.interop.hf_check import weights_dtype
from titan_ulysses.interop.peft_export import merge, pop_adapters, scaling_of
from titan_ulysses.checkpoint.steps import missing_checkpoint
from titan_ulysses.checkpoint.verify import verify_checkpoint
from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling
from titan_ulysses.models.families.common import rope_config
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


# -- config.json -----------------------------------------------------------------------------


def _hf_numel(parts: list, meta: dict) -> int:
    """Elements of one Hugging Face tensor (one expert of a stacked weight, or its parts' sum)."""
    if is_expert(parts) and parts[0].layout == "t":
        size = meta[parts[0].name].size
        return size.numel() // size[0]
    return sum(meta[part_name(p)].size.numel() for p in parts)


def hf_config(args: DecoderArgs, dtype: torch.dtype, max_position_embeddings: int = 131072,
              base: dict | None = None, trained_seq_len: int = 0) -> dict:
    """config.json for ``args``: ``base`` (the source folder's, when there is one) with every shape written over.

    ``max_position_embeddings`` is the source's (else the argument), raised to the trained
    length; with yarn it is ``original x factor``, the length transformers checks yarn's factor against.
    """
    family = get_family(args.family)
    config = dict(base or {})
    config.pop("rope_parameters", None)  # written below as rope_theta + rope_scaling, which every version reads
    max_pos = max(config.get("max_position_embeddings", max_position_embeddings), trained_seq_len)
    s = args.rope_scaling
    if s is not None and s.rope_type == "yarn":
        max_pos = max(int(s.original_max_position_embeddings * s.factor), trained_seq_len)
    config.update({
        "architectures": [family.architecture],
        "model_type": args.family,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),  # the key transformers >= 4.56 reads
    })
    extra = family.export_config(args, config)
    remove = extra.pop("_remove", ())  # keys the family spells otherwise (Gemma: rope_parameters per layer type)
    config.update(extra)
    config["rope_scaling"] = rope_config(args)
    if config["rope_scaling"] is None and base is None:
        del config["rope_scaling"]
    for key in remove:
        config.pop(key, None)
    return config


# -- weights ---------------------------------------------------------------------------------


def _model_metadata(checkpoint_dir: str) -> dict[str, TensorStorageMetadata]:
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    model = {
        key[len("model."):]: meta for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{checkpoint_dir!r} holds no model weights")
    return model


def check_checkpoint_shapes(found: dict[str, tuple], args: DecoderArgs, what: str) -> None:
    """Refuse (ValueError, one line) a checkpoint whose tensors are not those of a model of ``args``."""
    expected = our_shapes(args)
    if expected != found:
        missing = sorted(set(expected) - set(found))[:3]
        extra = sorted(set(found) - set(expected))[:3]
        shape = [f"{k} {list(found[k])} (expected {list(expected[k])})"
                 for k in expected.keys() & found.keys() if expected[k] != found[k]][:2]
        raise ValueError(f"the checkpoint does not match the model arguments {what}: "
                         f"missing {missing}, unexpected {extra}, other shapes {shape}")


def record_hint(checkpoint_dir: str) -> str:
    """What the checkpoint's record says its model is, as the setting that gives it."""
    from titan_ulysses.models.flavors import FLAVORS

    try:
        record = read_model_record(checkpoint_dir)
    except (OSError, ValueError, TypeError):
        record = None
    if record is None:
        return "; set model.flavor or model.hf_assets_path to the model that wrote it"
    args, hf = record
    if hf is not None:
        return (f"; it records a Hugging Face model ({get_family(args.family).architecture}, {args.n_layers} layers, dim "
                f"{args.dim}): set model.hf_assets_path to that folder")
    same = lambda a: dataclasses.replace(a, rope_theta=0.0, rope_scaling=None)  # noqa: E731 (shapes only)
    flavor = next((name for name, f in FLAVORS.items() if same(f) == same(args)), None)
    return (f"; it records model.flavor {flavor!r}: set --model.flavor {flavor}" if flavor else
            f"; it records {args.n_layers} layers, dim {args.dim}: set model.flavor to that model's")


def check_dcp_model_shapes(checkpoint_dir: str, args: DecoderArgs) -> None:
    """Refuse, from its .metadata alone, a checkpoint whose model does not have the shapes of ``args``."""
    reason = missing_checkpoint(checkpoint_dir)
    if reason:
        raise FileNotFoundError(reason)
    meta = _model_metadata(checkpoint_dir)
    pop_adapters(meta)  # a LoRA run's adapters: their base weights are what must fit
    found = {k: tuple(m.size) for k, m in meta.items()}
    try:
        check_checkpoint_shapes(found, args, "of this run (model.flavor / model.hf_assets_path)")
    except ValueError as e:
        raise ValueError(f"{e}{record_hint(checkpoint_dir)}") from None


def read_model_weights(checkpoint_dir: str, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of a checkpoint (all, or ``names``), read without a process group."""
    metadata = _model_metadata(checkpoint_dir)
    model = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
             if names is None or k in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=checkpoint_dir, no_dist=True)
    return model


def source_dtype(checkpoint_dir: str) -> tuple[torch.dtype, str]:
    """The dtype an export writes by default (the one the weights came in), and where it comes from.

    A run started from a Hugging Face folder: the dtype of that folder's safetensors, recorded in
    ``model_args.json`` (``weights_dtype``). Its config.json's ``dtype`` / ``torch_dtype`` is only a
    claim (one said bfloat16 over F32 files, and the export downcast them), so it never decides; when
    it disagrees, the reason says so. A run from scratch, or a checkpoint recorded before
    ``weights_dtype`` existed: the dtype of the parameters as saved.
    """
    record = _read_record(checkpoint_dir) or {}
    hf = record.get("hf_config") or {}
    recorded = record.get("weights_dtype")
    if isinstance(recorded, str) and isinstance(getattr(torch, recorded, None), torch.dtype):
        dtype, why = getattr(torch, recorded), "the dtype of the source weights"
    else:
        dtypes = {m.properties.dtype for m in _model_metadata(checkpoint_dir).values()}
        dtype = max(dtypes, key=lambda d: d.itemsize)  # mixed (none today): the widest
        why = "the dtype of the saved parameters"
        if hf:
            why += " (the checkpoint does not record its source weights' dtype)"
    claimed = hf.get("dtype") or hf.get("torch_dtype")
    if isinstance(claimed, str) and claimed.removeprefix("torch.") != str(dtype).removeprefix("torch."):
        why += f"; the source config.json says {claimed.removeprefix('torch.')} (--dtype writes another)"
    return dtype, why


def _plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    shards, current, total = [], [], 0
    for name, size in sizes.items():
        if current and total + size > max_shard_size:
            shards.append(current)
            current, total = [], 0
        current.append(name)
        total += size
    return shards + [current] if current else shards


def export_hf(checkpoint_dir: str, args: DecoderArgs | None, output_dir: str, dtype: torch.dtype | None = None,
              max_position_embeddings: int = 131072, max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write a Hugging Face folder for ``checkpoint_dir``; ``args`` None reads them from its record.

    ``dtype`` None writes the dtype the weights came in (``source_dtype``). Verifies the checkpoint
    against its manifest before reading anything (``verify.py``). Returns the names of
    the files written.
    """
    from safetensors.torch import save_file

    verify_checkpoint(checkpoint_dir, "--checkpoint")  # nothing is read from a checkpoint that fails it
    if dtype is None:
        dtype = source_dtype(checkpoint_dir)[0]

    record = read_model_record(checkpoint_dir)
    base = None
    if args is None:
        if record is None:
            raise ValueError(f"{checkpoint_dir!r} has no {RECORD} (a checkpoint written before it existed); "
                             f"pass --flavor (and the run's rope overrides)")
        args, base = record
    elif record is not None:
        base = record[1]
    meta = _model_metadata(checkpoint_dir)
    adapters = pop_adapters(meta)  # a LoRA run's: merged into their base weights below
    scaling = scaling_of(checkpoint_dir, adapters)
    check_checkpoint_shapes({k: tuple(m.size) for k, m in meta.items()}, args, "given (flavor / overrides)")
    tensors = hf_tensors(args)
    sizes = {theirs: _hf_numel(parts, meta) * dtype.itemsize for theirs, parts in tensors.items()}
    shards = _plan_shards(sizes, max_shard_size)
    os.makedirs(output_dir, exist_ok=True)
    weight_map, written, total = {}, [], 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        state = {}
        names = list(dict.fromkeys(part_name(p) for theirs in shard for p in tensors[theirs]))  # an expert weight once
        ours_state = read_model_weights(checkpoint_dir, names + [n for ours in names for n in adapters.get(ours, ())])
        for theirs in shard:
            if is_expert(tensors[theirs]):  # no LoRA on experts (refused at launch)
                state[theirs] = experts_to_theirs(tensors[theirs], ours_state).to(dtype).contiguous()
                weight_map[theirs] = file
                total += sizes[theirs]
                continue
            parts = []
            for ours, heads in tensors[theirs]:
                w = ours_state.pop(ours)
                if ours in adapters:  # a LoRA run's adapted weight: W + alpha/rank * B @ A, in our layout
                    w = merge(w, ours_state.pop(adapters[ours][0]), ours_state.pop(adapters[ours][1]), scaling)
                parts.append(ours_to_theirs(w, heads, args))
            state[theirs] = join(parts).to(dtype).contiguous()
            weight_map[theirs] = file
            total += sizes[theirs]
        del ours_state
        save_file(state, os.path.join(output_dir, file), metadata={"format": "pt"})
        written.append(file)
        del state
    if len(shards) > 1:
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append("model.safetensors.index.json")
    assets = os.path.join(checkpoint_dir, ASSETS)
    if os.path.isdir(assets):
        for name in sorted(os.listdir(assets)):
            if name != "config.json":
                shutil.copyfile(os.path.join(assets, name), os.path.join(output_dir, name))
                written.append(name)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(hf_config(args, dtype, max_position_embeddings, base, recorded_seq_len(checkpoint_dir)), f, indent=2)
    return written + ["config.json"]
