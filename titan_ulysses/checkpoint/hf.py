"""Load a Hugging Face folder's safetensors into a parallelized model, each rank reading only its shards.

The model's own sharded state dict (DTensors under FSDP2 / TP) is renamed to Hugging
Face's names by the family's adapter (``hf_adapter.py``) and handed to
``torch.distributed.checkpoint.load`` with its ``HuggingFaceStorageReader``: DCP plans,
for every local shard, the slice of the stored tensor it covers, and the reader copies
just that slice out of the memory-mapped file (converting bf16 -> fp32 on the way). No
rank ever holds the full model. Most tensors are read straight into the parameters.
The RoPE-ordered ones (q/k weights, biases, norm weights) are read into a buffer of the
same sharding, gathered one tensor at a time, permuted into our layout and re-sliced
locally: the transient peak is one full q projection, not the model.

Export (the other direction) lives in ``hf_export.py``.
"""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_ulysses.checkpoint.hf_adapter import (  # noqa: F401 (interleaved_to_halves: public here since export)
    expected_hf_shapes,
    halves_to_interleaved,
    interleaved_to_halves,
    name_map,
)
from titan_ulysses.checkpoint.hf_export import export_hf, hf_config, read_model_weights  # noqa: F401
from titan_ulysses.models.llama.args import LlamaArgs


def safetensors_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder's ``*.safetensors`` (headers only, no data read)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder!r} has no *.safetensors weights")
    shapes = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_hf_weights(folder: str, args: LlamaArgs) -> None:
    """Refuse (ValueError, one line) weights that are missing or shaped unlike ``args`` (from config.json)."""
    found = safetensors_shapes(folder)
    expected = expected_hf_shapes(args)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) that config.json implies are not in the safetensors files, "
                         f"e.g. {missing[0]!r}")
    for name, shape in expected.items():
        if found[name] != shape:
            raise ValueError(f"{name!r} has shape {list(found[name])} in the safetensors files but "
                             f"{list(shape)} by config.json")


def _to_our_layout(buf: torch.Tensor, heads: int) -> torch.Tensor:
    """A RoPE-ordered tensor read in Hugging Face's layout, in ours, with the same sharding."""
    if not isinstance(buf, DTensor):
        return halves_to_interleaved(buf, heads)
    full = halves_to_interleaved(buf.full_tensor(), heads)
    # every rank now holds the full tensor: take the local slice, no communication
    return distribute_tensor(full, buf.device_mesh, buf.placements, src_data_rank=None)


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str, thread_count: int = 1) -> None:
    """Load the folder's weights into ``model`` (parallelized or not; ``model.args`` gives the family)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    names = name_map(model.args)
    everything = get_model_state_dict(model)
    state = {k: v for k, v in everything.items() if not k.endswith((".lora_A", ".lora_B"))}
    hf_state, permuted = {}, {}
    for ours, tensor in state.items():
        theirs, heads = names[ours]
        if heads:
            permuted[ours] = (torch.empty_like(tensor), heads)
            hf_state[theirs] = permuted[ours][0]
        else:
            hf_state[theirs] = tensor
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(folder, thread_count=thread_count))
    for ours, (buf, heads) in permuted.items():
        state[ours] = _to_our_layout(buf, heads)
    # LoRA adapters are not in the folder: they keep their values (init_lora or a checkpoint)
    set_model_state_dict(model, state, options=StateDictOptions(strict=len(state) == len(everything)))
