"""A DCP checkpoint -> a Hugging Face model folder that ``transformers`` loads (the record that makes it possible
is ``model_record.py``'s).

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

import torch

from titan_ulysses.interop.hf_adapter import (
    experts_to_theirs,
    hf_tensors,
    is_expert,
    join,
    our_shapes,
    ours_to_theirs,
    part_name,
)
from titan_ulysses.interop.model_record import (  # noqa: F401 (the record's names, imported from here before)
    ASSET_SUFFIXES,
    ASSETS,
    RECORD,
    _read_record,
    model_metadata,
    read_data_settings,
    read_model_record,
    read_model_weights,
    recorded_seq_len,
    write_model_record,
)
from titan_ulysses.interop.peft_export import merge, pop_adapters, scaling_of
from titan_ulysses.checkpoint.steps import missing_checkpoint
from titan_ulysses.checkpoint.verify import verify_checkpoint
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.families.common import rope_config
from titan_ulysses.models.registry import get_family

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
    meta = model_metadata(checkpoint_dir)
    pop_adapters(meta)  # a LoRA run's adapters: their base weights are what must fit
    found = {k: tuple(m.size) for k, m in meta.items()}
    try:
        check_checkpoint_shapes(found, args, "of this run (model.flavor / model.hf_assets_path)")
    except ValueError as e:
        raise ValueError(f"{e}{record_hint(checkpoint_dir)}") from None


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
        dtypes = {m.properties.dtype for m in model_metadata(checkpoint_dir).values()}
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


def _model_of(checkpoint_dir: str, args: DecoderArgs | None) -> tuple[DecoderArgs, dict | None]:
    """The model to export (``args``, else the checkpoint's record) and the source config.json (None: none)."""
    record = read_model_record(checkpoint_dir)
    if args is not None:
        return args, record[1] if record is not None else None
    if record is None:
        raise ValueError(f"{checkpoint_dir!r} has no {RECORD} (a checkpoint written before it existed); "
                         f"pass --flavor (and the run's rope overrides)")
    return record


def _shard_state(checkpoint_dir: str, shard: list[str], tensors: dict, adapters: dict, scaling: float,
                 args: DecoderArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of one output shard, read from the checkpoint (a LoRA run's adapters merged)."""
    names = list(dict.fromkeys(part_name(p) for theirs in shard for p in tensors[theirs]))  # an expert weight once
    ours_state = read_model_weights(checkpoint_dir, names + [n for ours in names for n in adapters.get(ours, ())])
    state = {}
    for theirs in shard:
        if is_expert(tensors[theirs]):  # no LoRA on experts (refused at launch)
            state[theirs] = experts_to_theirs(tensors[theirs], ours_state).to(dtype).contiguous()
            continue
        parts = []
        for ours, heads in tensors[theirs]:
            w = ours_state.pop(ours)
            if ours in adapters:  # a LoRA run's adapted weight: W + alpha/rank * B @ A, in our layout
                w = merge(w, ours_state.pop(adapters[ours][0]), ours_state.pop(adapters[ours][1]), scaling)
            parts.append(ours_to_theirs(w, heads, args))
        state[theirs] = join(parts).to(dtype).contiguous()
    return state


def _write_weights(checkpoint_dir: str, args: DecoderArgs, output_dir: str, dtype: torch.dtype,
                   max_shard_size: int) -> list[str]:
    """The safetensors files (one, or shards with their index), one shard in host memory at a time."""
    from safetensors.torch import save_file

    meta = model_metadata(checkpoint_dir)
    adapters = pop_adapters(meta)  # a LoRA run's: merged into their base weights
    scaling = scaling_of(checkpoint_dir, adapters)
    check_checkpoint_shapes({k: tuple(m.size) for k, m in meta.items()}, args, "given (flavor / overrides)")
    tensors = hf_tensors(args)
    sizes = {theirs: _hf_numel(parts, meta) * dtype.itemsize for theirs, parts in tensors.items()}
    shards = _plan_shards(sizes, max_shard_size)
    written, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_shard_state(checkpoint_dir, shard, tensors, adapters, scaling, args, dtype),
                  os.path.join(output_dir, file), metadata={"format": "pt"})
        written.append(file)
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, f, indent=2)
        written.append("model.safetensors.index.json")
    return written


def _copy_assets(checkpoint_dir: str, output_dir: str) -> list[str]:
    """The source folder's tokenizer and other files the checkpoint carries (``hf_assets/``), but config.json."""
    assets = os.path.join(checkpoint_dir, ASSETS)
    names = sorted(n for n in os.listdir(assets) if n != "config.json") if os.path.isdir(assets) else []
    for name in names:
        shutil.copyfile(os.path.join(assets, name), os.path.join(output_dir, name))
    return names


def export_hf(checkpoint_dir: str, args: DecoderArgs | None, output_dir: str, dtype: torch.dtype | None = None,
              max_position_embeddings: int = 131072, max_shard_size: int = 5 * 2**30) -> list[str]:
    """Write a Hugging Face folder for ``checkpoint_dir``; ``args`` None reads them from its record.

    ``dtype`` None writes the dtype the weights came in (``source_dtype``). Verifies the checkpoint
    against its manifest before reading anything (``verify.py``). Returns the names of
    the files written.
    """
    verify_checkpoint(checkpoint_dir, "--checkpoint")  # nothing is read from a checkpoint that fails it
    dtype = dtype or source_dtype(checkpoint_dir)[0]
    args, base = _model_of(checkpoint_dir, args)
    os.makedirs(output_dir, exist_ok=True)
    written = _write_weights(checkpoint_dir, args, output_dir, dtype, max_shard_size)
    written += _copy_assets(checkpoint_dir, output_dir)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(hf_config(args, dtype, max_position_embeddings, base, recorded_seq_len(checkpoint_dir)), f, indent=2)
    return written + ["config.json"]
