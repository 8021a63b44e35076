"""Load a Hugging Face folder's safetensors into a parallelized model, each rank reading only its shards.

The model's own sharded state dict (DTensors under FSDP2 / TP) is renamed to Hugging
Face's names by the family's adapter (``hf_adapter.py``) and handed to
``torch.distributed.checkpoint.load`` with its ``HuggingFaceStorageReader``: DCP plans,
for every local shard, the slice of the stored tensor it covers, and the reader copies
just that slice out of the memory-mapped file (converting bf16 -> fp32 on the way). No
rank ever holds the full model. Most tensors are read straight into the parameters.
The RoPE-ordered ones (q/k weights, biases, norm weights) and the fused projections (Phi-3's
qkv_proj, gate_up_proj) are read whole into a plain buffer, one tensor at a time in DCP's
plan, split and permuted into our layout and re-sliced locally: the transient peak is one
full fused projection per such tensor, not the model.

What must hold before (dtypes, no tensor left unused, the index's files) is checked in
``hf_check.py`` by the pre-flight; export (the other direction) lives in ``hf_export.py``.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_ulysses.interop.hf_adapter import (  # noqa: F401 (interleaved_to_halves: public here since export)
    halves_to_interleaved,
    hf_tensors,
    interleaved_to_halves,
    is_expert,
    split,
    theirs_to_ours,
)
from titan_ulysses.interop.hf_check import check_hf_weights  # noqa: F401 (public here: what the loader needs)
from titan_ulysses.interop.hf_experts import ExpertReads
from titan_ulysses.interop.hf_export import export_hf, hf_config, read_model_weights  # noqa: F401


def _place_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` sharded as ``like`` is (every rank holds ``full``: a local slice, no communication)."""
    if not isinstance(like, DTensor):
        return full.to(like.dtype)
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str, thread_count: int = 1) -> None:
    """Load the folder's weights into ``model`` (parallelized or not; ``model.args`` gives the family)."""
    import torch.distributed as dist

    from titan_ulysses.interop.hf_progress import ProgressReader

    args = model.args
    state = get_model_state_dict(model)  # LoRA adapters are not in the folder: they keep their values
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    hf_state, transformed = {}, {}
    experts = ExpertReads(state)
    for theirs, parts in hf_tensors(args).items():
        if is_expert(parts):  # only this rank's experts (hf_experts.py)
            experts.plan(theirs, parts, hf_state)
            continue
        ours, heads = parts[0]
        if len(parts) == 1 and not heads:
            hf_state[theirs] = state[ours]  # read straight into the (sharded) parameter
            continue
        rows = sum(shapes[o][0] for o, _ in parts)
        like = state[ours]
        hf_state[theirs] = torch.empty((rows, *shapes[ours][1:]), dtype=like.dtype,
                                       device=like.device if not isinstance(like, DTensor) else like.to_local().device)
        transformed[theirs] = parts
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    dcp.load(hf_state, storage_reader=ProgressReader(folder, thread_count=thread_count, enabled=rank0))
    for theirs, parts in transformed.items():
        for (ours, heads), w in zip(parts, split(hf_state[theirs], parts, shapes)):
            state[ours] = _place_like(theirs_to_ours(w, heads, args), state[ours])
    state.update(experts.finish(hf_state))
    set_model_state_dict(model, state, options=StateDictOptions(strict=True))
