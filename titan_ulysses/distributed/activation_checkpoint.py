"""Activation checkpointing per transformer block.

* ``full``: recompute the whole block in backward (including the Ulysses all-to-alls).
* ``selective``: op-level selective checkpointing: keep the outputs of matmuls, attention
  kernels and collectives, recompute the cheap elementwise work (norms, RoPE, SiLU) --
  so backward neither redoes an all-to-all, context parallelism's K/V all-gather, nor an
  attention forward. (What the policy sees are aten and functional-collective ops; the
  attention inputs must be plain tensors -- ``SDPAAttention.causal_lower_right`` builds its
  lower-right causal mask from ints for that reason, see ``ops/attention/sdpa.py``.) The
  attention kernels kept are those the backends name in ``ops/attention/registry.py``.
* ``full_offload``: ``full``, and the one tensor each block still keeps (its input,
  ``[B, S/sp, D]``) goes to pinned host memory until backward needs it, the copies
  overlapped with compute on CUDA: see ``activation_offload.py``.

Groups (``activation_checkpoint.layers_per_checkpoint`` = k > 1, full and full_offload; Megatron's
uniform ``recompute_num_layers``): each block keeps its own checkpoint, and every k consecutive
blocks run under one more checkpoint (the last group may be shorter; a group of one is just its
block). Forward then keeps only each group's input (under full_offload, in host memory): an
inner block's input is packed by the group's checkpoint, which keeps nothing. Backward of a group
first runs the group's forward again, keeping its blocks' inputs on the device (k of them, one
restored from the host) until each block's own backward -- with its own recompute, as with k = 1
-- is done. Cost: one more forward of k - 1 blocks per group (PyTorch stops the group's recompute
once its last block's input is back): (k - 1) / k block forwards per layer, nearly one for large k.
Memory: the kept inputs shrink to 1/k; a group's backward holds k - 1 block inputs more than a
block's, and under FSDP k - 1 blocks' gathered parameters more (FSDP does not reshard after a
forward inside backward: the group's recompute gathers its blocks, their own backward frees them).
The forward of a group holds its input until the group returns: one block input more than k = 1.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_ulysses.ops.attention import save_ops as attention_save_ops
from titan_ulysses.ops.layer_stats import add_stats
from titan_ulysses.ops.tiled import tiled_forward_running

AC_MODES = ("none", "full", "selective", "full_offload")


# Ops whose outputs selective AC keeps besides the attention backends' (registry.save_ops);
# looked up by name, since the set differs between PyTorch builds.
_SAVE_OPS = (
    "aten.mm",
    "_c10d_functional.all_to_all_single",
    "_c10d_functional.all_gather_into_tensor",  # context parallelism's K/V
    "_c10d_functional.reduce_scatter_tensor",
)


def _save_list() -> set:
    ops = attention_save_ops()
    for name in _SAVE_OPS:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _selective_policy(save_ops, ctx, func, *args, **kwargs):
    # the tiled MLP's forward (ops/tiled.py) keeps only its input and recomputes each tile in
    # its own backward: keeping its matmuls' outputs here would keep every tile's [tile,
    # ffn_hidden] intermediates, which the tiling exists to avoid (the recompute runs the
    # tiles again, so forward and recompute decide alike)
    if func in save_ops and not tiled_forward_running():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(functools.partial(_selective_policy, _save_list()))


def check_layers_per_checkpoint(mode: str, layers_per_checkpoint: int) -> None:
    """Groups of layers exist only over blocks that recompute whole (full, full_offload)."""
    if layers_per_checkpoint > 1 and mode not in ("full", "full_offload"):
        raise ValueError(f"activation_checkpoint.layers_per_checkpoint {layers_per_checkpoint} needs "
                         f"activation_checkpoint.mode full or full_offload, not {mode!r}; set "
                         f"layers_per_checkpoint 1 or mode full_offload")


def _run_group(blocks: list[nn.Module], h, rope, attention_mask):
    stats = None
    for block in blocks:
        h, stats = add_stats(stats, block(h, rope, attention_mask))  # [B, S, D]
    return h if stats is None else (h, stats)


class CheckpointGroups:
    """``Transformer.layer_units``: ``layers`` in groups of ``k`` blocks, each group under one checkpoint
    around the blocks' own (module docstring)."""

    def __init__(self, k: int):
        self.k = k
        self.around_group = contextlib.nullcontext
        """Entered around each group's forward: ``activation_offload.py`` puts its saved-tensor hooks here."""

    def groups(self, layers: nn.ModuleDict) -> list[list[nn.Module]]:
        blocks = list(layers.values())  # at call time: compile and FSDP replace or wrap them after apply_ac
        return [blocks[i:i + self.k] for i in range(0, len(blocks), self.k)]

    def __call__(self, layers: nn.ModuleDict) -> list:
        return [functools.partial(self._run, blocks) for blocks in self.groups(layers)]

    def _run(self, blocks: list[nn.Module], h, rope, attention_mask):  # [B, S, D] -> [B, S, D]
        with self.around_group():
            if len(blocks) == 1:
                return blocks[0](h, rope, attention_mask)
            return checkpoint(_run_group, blocks, h, rope, attention_mask, use_reentrant=False,
                              preserve_rng_state=False)


def apply_ac(model: nn.Module, mode: str, layers_per_checkpoint: int = 1) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode {mode!r} is not one of {list(AC_MODES)}")
    check_layers_per_checkpoint(mode, layers_per_checkpoint)
    if layers_per_checkpoint > 1:
        if not hasattr(model, "layer_units"):
            raise ValueError(f"activation_checkpoint.layers_per_checkpoint {layers_per_checkpoint}: "
                             f"{type(model).__name__} has no layer_units to group; set layers_per_checkpoint 1")
        model.layer_units = CheckpointGroups(layers_per_checkpoint)
    if mode == "none":
        return
    for name, block in model.layers.named_children():
        if mode in ("full", "full_offload"):  # full_offload: plus activation_offload.py
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers.register_module(name, wrapped)
