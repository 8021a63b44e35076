"""This rank's slice of a batch and the loss of the whole mesh, for a model under ``apply_ulysses``.

:func:`shard_batch` cuts a full batch into this rank's slice (labels shifted on the full
sequence first), :func:`sp_loss` turns logits or transformers' per-rank mean loss into the
token mean of the whole mesh, and :func:`fsdp_mesh` is the mesh ``fully_shard`` must cover
(every rank: sp ranks hold the same parameters but see other tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.data.sharding import shard_batch as _shard
from titan_ulysses.ops.loss import IGNORE_INDEX

__all__ = ["fsdp_mesh", "shard_batch", "shifted_labels", "sp_loss"]


def _sp_mesh(mesh: DeviceMesh, sp_dim: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh is {type(mesh).__name__}, not a DeviceMesh: pass init_device_mesh(device, (dp, sp), "
                         f"mesh_dim_names=('dp', {sp_dim!r}))")
    names = mesh.mesh_dim_names or ()
    if sp_dim not in names:
        raise ValueError(f"mesh has dims {list(names)}, no {sp_dim!r}: name the sequence-parallel dim with sp_dim=")
    return mesh[sp_dim] if mesh.ndim > 1 else mesh


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Every rank of ``mesh`` as one 1-D mesh: what ``fully_shard`` shards over and reduces gradients on."""
    if mesh.ndim == 1:
        return mesh
    return mesh._flatten("_".join(mesh.mesh_dim_names))


def shard_batch(batch: dict, mesh: DeviceMesh, sp_dim: str = "sp", pad_token_id: int = 0) -> dict:
    """This sp rank's slice of a full batch (the same on every rank of an sp group).

    ``batch``: ``input_ids`` [B, S]; optional ``labels`` (transformers' convention: unshifted,
    -100 ignored; default ``input_ids``), ``position_ids`` (packed documents restart at 0) and
    ``attention_mask`` (right padding only). Returns ``input_ids``, ``position_ids`` (global)
    and ``shift_labels``: labels shifted on the full sequence, -100 on padding, so that
    position t predicts token t+1 even across the slice boundary. S is padded to a multiple of sp.
    """
    ids = batch["input_ids"]  # [B, S]
    if ids.dim() != 2:
        raise ValueError(f"shard_batch: input_ids has shape {tuple(ids.shape)}; pass [batch, seq] "
                         f"(ids[None] for one row)")
    for key in ("labels", "attention_mask", "position_ids"):
        if batch.get(key) is not None and tuple(batch[key].shape) != tuple(ids.shape):
            raise ValueError(f"shard_batch: {key} has shape {tuple(batch[key].shape)}, input_ids {tuple(ids.shape)}; "
                             f"give every row its own {key} of the same length")
    sp_mesh = _sp_mesh(mesh, sp_dim)
    shifted = shifted_labels(batch)
    part = _shard(ids, shifted, sp_mesh.get_local_rank(), sp_mesh.size(), positions=batch.get("position_ids"),
                  pad_token=pad_token_id)
    return {"input_ids": part.tokens.contiguous(), "position_ids": part.positions.contiguous(),
            "shift_labels": part.labels.contiguous()}  # [B, S_pad/sp] each; transformers' loss views them flat


def shifted_labels(batch: dict) -> torch.Tensor:
    """The full rows' labels shifted by one [B, S] (token t's label is token t+1), -100 on right padding.

    ``labels`` default to ``input_ids``; a padded ``attention_mask`` must pad on the right.
    """
    ids = batch["input_ids"]  # [B, S]
    labels = batch.get("labels")
    labels = ids if labels is None else labels
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S]: the label of token t is token t+1
    mask = batch.get("attention_mask")
    if mask is not None:
        mask = mask.bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise ValueError("shard_batch: attention_mask has padding before real tokens; pad on the right "
                             "(tokenizer.padding_side = 'right') or pack documents with position_ids")
        shifted = shifted.masked_fill(~F.pad(mask[:, 1:], (0, 1), value=False), IGNORE_INDEX)
    return shifted


def sp_loss(logits_or_loss: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The token-mean loss of the whole batch over every rank of ``mesh``, from this rank's share.

    ``logits_or_loss``: this rank's logits [B, S/P, V], or transformers' loss of them (the mean
    over this rank's tokens, from ``shift_labels``; a rank without loss tokens, whose mean is
    NaN, adds nothing), or the same mean from ``apply_ulysses(fused_loss=True)``'s ``.loss``. A batch without any loss token on the whole mesh gives loss 0 and zero
    gradients, not NaN.
    ``labels``: this rank's ``shift_labels``. As ``forward_backward``: this rank's summed token
    losses over the token count of the whole mesh (one all-reduce of the sum and the count). The
    value returned is that global mean on every rank; its gradient is the rank's share times
    the mesh size, which ``fully_shard``'s default mean over :func:`fsdp_mesh` turns into one
    process's gradient.
    """
    count = (labels != IGNORE_INDEX).sum()
    if logits_or_loss.dim() == 0:  # a rank without loss tokens holds transformers' NaN (0/0): it adds nothing
        local = torch.where(count > 0, logits_or_loss.float(), 0.0) * count
    else:
        if tuple(logits_or_loss.shape[:2]) != tuple(labels.shape):
            raise ValueError(f"sp_loss: logits {tuple(logits_or_loss.shape)} and labels {tuple(labels.shape)} differ "
                             f"in [batch, seq]; pass shard_batch's shift_labels for these logits")
        local = F.cross_entropy(logits_or_loss.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
    totals = torch.stack([local.detach(), count.to(local.dtype)])
    for dim in range(mesh.ndim):  # summed over every rank of the mesh
        if mesh.size(dim) > 1:
            dist.all_reduce(totals, group=mesh.get_group(dim))
    total, n_tokens = totals[0], totals[1].clamp(min=1)  # no loss token anywhere: loss 0, gradients 0
    share = local * mesh.size() / n_tokens
    return share + (total / n_tokens - share.detach())
