"""Context extension by the model's own RoPE method (``model.rope_scaling_factor`` / ``_type`` / ``_original``).

The method is the one the model already uses (its config.json ``rope_scaling``), else its
family's (llama3 for Llama and the named flavors, yarn for Qwen and Mistral, as their long-context
releases do), else ``model.rope_scaling_type``. ``original_max_position_embeddings`` is the
length the model was trained at: ``model.rope_original_max_position_embeddings`` when set, else the existing
scaling's, else config.json's ``max_position_embeddings`` (a flavor's: ``flavors.TRAINED_SEQ_LEN``).
The method or the original length given without a factor re-scales an existing scaling at its own
factor (it was silently ignored); a model without one is refused: there is no factor to keep.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.models.decoder.args import DecoderArgs, RopeScaling
from titan_ulysses.models.registry import get_family

METHODS = ("llama3", "yarn", "linear")


def extend_context(args: DecoderArgs, factor: float, method: str = "", original: int = 0,
                   max_position_embeddings: int = 0) -> DecoderArgs:
    """``args`` with RoPE scaled ``factor`` times by ``method`` ("" : the model's own); ValueError names the setting."""
    if factor <= 0 and (method or original) and args.rope_scaling is not None:
        factor = args.rope_scaling.factor  # another method or length at the model's own factor
    if factor <= 0:
        if method or original:
            given = (f"model.rope_scaling_type {method!r}" if method else
                     f"model.rope_original_max_position_embeddings {original}")
            raise ValueError(f"{given} without model.rope_scaling_factor: the model has no RoPE scaling whose factor "
                             f"it could keep; set model.rope_scaling_factor too")
        return args
    if factor < 1:  # as config.json's factor (interop/hf_ranges.py): transformers requires >= 1
        raise ValueError(f"model.rope_scaling_factor must be 0 (off) or >= 1 (how many times longer the context "
                         f"becomes), got {factor:g}")
    current = args.rope_scaling
    method = method or (current.rope_type if current else get_family(args.family).extension)
    if method not in METHODS:
        raise ValueError(
            f"model.rope_scaling_factor: model_type {args.family!r} " + (
                f"scales RoPE by {method!r}, which extends by the factors in its config.json, not by one factor"
                if method else "has no context-extension method of its own")
            + f"; set model.rope_scaling_type to one of {list(METHODS)}")
    if current is not None and current.rope_type == method:  # the same method, stretched further
        return dataclasses.replace(args, rope_scaling=dataclasses.replace(
            current, factor=factor, original_max_position_embeddings=original or current.original_max_position_embeddings))
    original = original or max_position_embeddings or (current.original_max_position_embeddings if current else 0)
    scaling = RopeScaling(rope_type=method, factor=factor)  # llama3: low 1, high 4, original 8192 by default
    if original:
        scaling.original_max_position_embeddings = original
    return dataclasses.replace(args, rope_scaling=scaling)
