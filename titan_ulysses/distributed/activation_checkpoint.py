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
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_ulysses.ops.attention import save_ops as attention_save_ops
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


def apply_ac(model: nn.Module, mode: str) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode {mode!r} is not one of {list(AC_MODES)}")
    if mode == "none":
        return
    for name, block in model.layers.named_children():
        if mode in ("full", "full_offload"):  # full_offload: plus activation_offload.py
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers.register_module(name, wrapped)
