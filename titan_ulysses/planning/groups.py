"""Activation checkpointing in groups of k blocks in the memory estimate (``memory_estimate.py``).

``activation_checkpoint.layers_per_checkpoint`` = k > 1 (``Switches.ac_layers_per_checkpoint``,
``distributed/activation_checkpoint.py``): under full AC or full_offload, forward keeps only each
group's input -- ``ceil(N / k)`` block inputs of ``a D`` bytes per local token instead of ``N``,
on the device (full) or in host memory (full_offload); the blocks' bf16 RoPE copies stay as with
k = 1. The backward of block ``i``, the ``j``-th of its group ``g`` (``i = g k + j``), holds beside
what it holds with k = 1 (counted against PyTorch's ``FSDPMemTracker``, ``metrics/memory_track.py``,
the 8B shape in 8 layers at k = 1, 2 and 4, full_offload and full):

* the inputs of the ``j`` blocks below it in its group, which the group's recompute made and their
  own backward frees (full: the inputs of the other blocks of the groups below are gone);
* those ``j`` blocks' gathered compute-dtype parameters: FSDP does not reshard after a forward
  inside backward, so the group's recompute leaves them unsharded until their own backward;
* under full_offload, in the lowest group (``g = 0``, ``j > 0``), no block input on its way back
  from the host (no group below it);
* ``4 Dh`` bytes per local token, the size of the root's fp32 RoPE tables, from the loss's backward
  to the end of the blocks' (the tracker's; not traced to a line of code).

Not a phase here: forward holds one block input more than k = 1 (a group's input until it returns).
Host memory with FSDP CPU offload (``Switches.cpu_offload``): the sharded fp32 parameters and the
optimizer state throughout, and the gradients from the blocks' reduce-scatters on, while the block
inputs return to the device: the larger of the two ends of backward.
"""

from __future__ import annotations

GROUPED_MODES = ("full", "full_offload")


def group_size(ac_mode: str, layers_per_checkpoint: int) -> int:
    """Blocks per checkpoint: ``layers_per_checkpoint`` under full AC or full_offload, else 1."""
    return layers_per_checkpoint if ac_mode in GROUPED_MODES else 1


def kept_inputs(n_layers: int, k: int) -> int:
    """Block inputs forward keeps (on the device under full AC, on the host under full_offload)."""
    return -(-n_layers // k)


def layer_backward_extra(i: int, k: int, ac_mode: str, block_input: float, one_block: float,
                         rope_tables: float) -> float:
    """Bytes block ``i``'s backward holds beyond the k = 1 estimate's (module docstring); 0 for k = 1.
    ``block_input``: one block input (``a D T``); ``one_block``: one block's compute-dtype parameters;
    ``rope_tables``: ``4 Dh T``."""
    if k == 1:
        return 0.0
    g, j = divmod(i, k)
    extra = j * (block_input + one_block) + rope_tables
    if ac_mode == "full":  # the k = 1 estimate counts every block input below; only the groups' are kept
        extra -= (i - g) * block_input
    if ac_mode == "full_offload" and g == 0 and j > 0:  # the k = 1 estimate's input coming back from the host
        extra -= block_input
    return extra


def host_bytes(parameters: float, gradients: float, optimizer: float, earlier: float, offloaded: float) -> float:
    """Host memory at its peak: with FSDP CPU offload, its states (gradients only from backward on, or
    ``earlier`` ones from the microbatches before) beside the offloaded inputs, or all the states at the end."""
    return max(parameters + optimizer + earlier + offloaded, parameters + optimizer + gradients)
