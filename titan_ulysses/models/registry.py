"""Model families keyed by Hugging Face ``model_type``: everything that differs between them in one entry.

Every family is the decoder of ``models/decoder/``. A family says only what differs: how
config.json becomes its arguments, which tensors its safetensors hold (names, fused
projections, RoPE-ordered rows), what its exported config.json adds, what its decoder does
differently (``DecoderSpec``: norms, embedding scale, the feed-forward) and, where its layers keep
more for backward than the decoder's, its per-layer memory terms. The trainer, the memory estimate and
tracker, HF load and export ask :func:`get_family` / :func:`build_model` /
:func:`parallelize_model`; a new family is one file under ``families/`` and one line in
``families/__init__.py``.

This file imports no family: each registers itself (:func:`register`) when ``models/families`` is imported,
which ``models/__init__.py`` does once, so every family is known to whoever imports anything of ``models/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.decoder.model import Transformer
from titan_ulysses.models.decoder.parallelize import parallelize_decoder
from titan_ulysses.models.decoder.spec import DecoderSpec
from titan_ulysses.ops.attention import get_backend
from titan_ulysses.ops.attention import registry as attention_registry

@dataclass(frozen=True)
class ExpertPart:
    """A Hugging Face tensor's part that is (part of) a stacked expert weight of ours, ``[E, in, out]``."""

    name: str
    """Our stacked weight (``layers.i.feed_forward.experts.w1`` ...)."""
    expert: int
    """The expert whose ``F.linear`` weight the tensor is (``layout`` "t"); -1: all of them, stacked."""
    layout: str
    """"t": theirs is ``ours[expert].T``; "even" / "odd": theirs ``[E, in, 2 out]`` interleaves two of ours
    along its last dim, this part at the even / odd places (gpt-oss's ``gate_up_proj``)."""


# Hugging Face name -> the parts of it in order: (our name, heads whose rows are RoPE-ordered or 0), or an
# ExpertPart. One part: a renamed tensor; several: a fused projection (rows concatenated in this order).
HFTensors = dict[str, list]


class HFConfigError(ValueError):
    """config.json describes a model this trainer cannot train exactly; the message names the field."""


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    """config.json's ``model_type``."""
    architecture: str
    """The transformers class ``AutoModelForCausalLM`` builds (config.json ``architectures``)."""
    args_from_config: Callable[[dict], DecoderArgs]
    """config.json (parsed) -> model arguments; raises HFConfigError naming a field it cannot train."""
    hf_tensors: Callable[[DecoderArgs], HFTensors]
    """The Hugging Face tensors of a model of these arguments and where each comes from."""
    export_config: Callable[[DecoderArgs, dict], dict]
    """The family's own config.json keys, written over the shared ones by export."""
    extension: str = ""
    """RoPE method its context extension uses when config.json has none (models/extension.py); "": none."""
    decoder: DecoderSpec = DecoderSpec()
    """What its decoder does differently from Llama's beyond config.json's numbers (Llama's: none)."""
    layer_memory: Callable | None = None
    """``(decoder_terms, args, Layout, Switches, ac_mode) ->`` bytes one layer keeps for backward per local token,
    where ``decoder_terms`` (the same arguments less itself) counts the decoder's
    (``planning/layer_terms.layer_bytes_per_token``); None: the decoder's alone."""
    args_class: type = DecoderArgs
    """The dataclass of its model arguments (a checkpoint's model_args.json is read back into it)."""


FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.model_type] = family
    return family


def get_family(model_type: str) -> ModelFamily:
    if model_type not in FAMILIES:
        raise HFConfigError(f"model_type {model_type!r} is not supported (one of {sorted(FAMILIES)})")
    return FAMILIES[model_type]


def build_model(args: DecoderArgs, compute: ComputeOptions | None = None) -> nn.Module:
    """The (non-distributed) decoder of ``args.family`` (Llama flavors: "llama"), computing as ``compute``
    (ComputeOptions) says; under ``torch.device("meta")`` for big models."""
    return Transformer(args, compute, get_family(args.family).decoder)


def num_params(args: DecoderArgs) -> int:
    """Parameters of the model ``args`` builds (its family's decoder, counted on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(args).parameters())


def check_compute(args: DecoderArgs, attn_backend: str, sdpa_backends: str = "auto") -> None:
    """Refuse (ValueError, one line) a backend that cannot compute what the model needs (windows, softcap),
    by the attention registry's capabilities."""
    backend = get_backend(attn_backend)
    needs = [(cap, what) for cap, what, on in (
        ("window", f"sliding_window {args.sliding_window}", args.sliding_window),
        ("softcap", f"attn_logit_softcapping {args.attn_softcap}", args.attn_softcap),
        ("sinks", "attention sinks", args.attn_sinks),
    ) if on]
    for cap, what in needs:
        if not getattr(backend, cap):
            able = [b.name for b in attention_registry.BACKENDS.values() if getattr(b, cap)]
            raise ValueError(f"model.attn_backend {attn_backend!r} cannot compute {args.family}'s {what}; "
                             f"use one of {able}")


def parallelize_model(model: nn.Module, parallel_dims, options=None) -> nn.Module:
    """Lay ``model`` out on the mesh (``ParallelizeOptions``): the decoder's fixed order, every family alike."""
    return parallelize_decoder(model, parallel_dims, options)
