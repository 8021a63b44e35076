"""Activation checkpointing in groups of k blocks in the memory estimate (``estimate.py``).

``activation_checkpoint.layers_per_checkpoint`` = k > 1 under full AC or full_offload: forward keeps one input
per group, ``ceil(N / k)`` instead of ``N`` (on the device under full, on the host under full_offload), and a
block's backward holds what its group's recompute made for the blocks below it. Each term was counted to the
byte against the tracker (the 8B shape in 8 layers at k = 1, 2 and 4, full and full_offload;
``tests/test_memory_track.py``); docs/memory_model.md, "What a layer keeps".
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
    """Bytes block ``i`` (the ``j``-th of group ``g``) holds in its backward beyond the k = 1 estimate's; 0 for
    k = 1. ``block_input``: one block input (``a D T``); ``one_block``: one block's compute-dtype parameters;
    ``rope_tables``: ``4 Dh T``."""
    if k == 1:
        return 0.0
    g, j = divmod(i, k)
    # the inputs of the j blocks below it in its group, which the group's recompute made and their own backward
    # frees, and their gathered parameters (FSDP does not reshard after a forward inside backward); and, from
    # the loss's backward to the end of the blocks', a term the size of the root's fp32 RoPE tables (the
    # tracker's; not traced to a line of code)
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
