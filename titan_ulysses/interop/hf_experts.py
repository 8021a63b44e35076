"""Expert weights from a Hugging Face folder, each rank reading only the experts it holds.

Our stacked ``[E, in, out]`` weights are sharded over experts (``ep``, then FSDP over the
ranks outside it), so a rank holds a contiguous range of experts. Per-expert tensors
(Qwen3-MoE, Mixtral: ``experts.{e}.gate_proj.weight``, ``F.linear``'s ``[out, in]``) are
requested only for the experts in that range; stacked ones (gpt-oss's ``gate_up_proj``
``[E, in, 2 out]``, gate and up interleaved) through a buffer sharded like the weight, so
DCP reads just this rank's rows. No rank reads another's experts.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_ulysses.interop.hf_adapter import experts_from_theirs
from titan_ulysses.models.registry import ExpertPart


def _local(like: torch.Tensor, shape: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], int]:
    """(local shape, first expert) of a tensor of ``shape`` (default ``like``'s) sharded as ``like`` is."""
    shape = tuple(shape or like.shape)
    if not isinstance(like, DTensor):
        return shape, 0
    local, offset = compute_local_shape_and_global_offset(shape, like.device_mesh, like.placements)
    return tuple(local), offset[0]


def _device(like: torch.Tensor) -> torch.device:
    return like.to_local().device if isinstance(like, DTensor) else like.device


def _sharded_like(local: torch.Tensor, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(like, DTensor):
        return local
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=torch.Size(shape), stride=stride)


class ExpertReads:
    """The requests for one load (``plan``), then our weights from what DCP read (``finish``)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.requests: dict[str, list[ExpertPart]] = {}
        self.locals: dict[str, torch.Tensor] = {}

    def plan(self, theirs: str, parts: list[ExpertPart], hf_state: dict) -> None:
        like = self.state[parts[0].name]  # [E, in, out]
        if parts[0].layout == "t":
            local, first = _local(like)
            if first <= parts[0].expert < first + local[0]:  # one of this rank's experts: [out, in]
                hf_state[theirs] = torch.empty(like.shape[2], like.shape[1], dtype=like.dtype, device=_device(like))
                self.requests[theirs] = parts
            return
        shape = (*like.shape[:-1], 2 * like.shape[-1])  # stacked, interleaved: this rank's rows only
        local, _ = _local(like, shape)
        hf_state[theirs] = _sharded_like(torch.empty(local, dtype=like.dtype, device=_device(like)), like, shape)
        self.requests[theirs] = parts

    def finish(self, hf_state: dict) -> dict[str, torch.Tensor]:
        """Our expert weights (sharded as the model's), from the tensors DCP filled."""
        for theirs, parts in self.requests.items():
            read = hf_state[theirs]
            read = read.to_local() if isinstance(read, DTensor) else read
            for part, w in zip(parts, experts_from_theirs(read, parts)):
                like = self.state[part.name]
                if part.layout != "t":
                    self.locals[part.name] = w.contiguous()
                    continue
                local, first = _local(like)
                if part.name not in self.locals:
                    self.locals[part.name] = torch.empty(local, dtype=like.dtype, device=_device(like))
                self.locals[part.name][part.expert - first] = w
        return {name: _sharded_like(local, self.state[name], tuple(self.state[name].shape))
                for name, local in self.locals.items()}
