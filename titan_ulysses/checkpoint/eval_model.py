"""A checkpoint's model laid out as training lays it out, for evaluation (eval_needle, eval_long, generate).

The weights are a step-N checkpoint's, or a Hugging Face folder's (the model before training).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from titan_ulysses.interop.hf_weights import check_hf_weights, load_hf_weights
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.checkpoint.weight_source import hf_has_weights
from titan_ulysses.config.manager import ConfigError
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.models.registry import build_model, parallelize_model


def weights_kind(path: str) -> str:
    """``"checkpoint"`` for a complete step-N folder (its ``.metadata``), ``"hf"`` for a Hugging Face
    folder (config.json and safetensors: e.g. the weights a run starts from), ``""`` otherwise."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "checkpoint"
    if os.path.isfile(os.path.join(path, "config.json")) and hf_has_weights(path):
        return "hf"
    return ""


def check_weights(path: str, args) -> None:
    """ConfigError (one line naming ``path``) unless it is a checkpoint or a Hugging Face folder of ``args``' shapes."""
    kind = weights_kind(path)
    if not kind:
        raise ConfigError(f"--checkpoint {path!r} is neither a complete checkpoint (no .metadata: point it at a "
                         f"step-N folder of checkpoint.folder) nor a Hugging Face folder (config.json and safetensors)")
    if kind == "hf":
        try:
            check_hf_weights(path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--checkpoint {path!r}: {e}") from e


def load_eval_model(args, compute, parallel_dims, device: torch.device, checkpoint: str) -> nn.Module:
    """Build ``args``' family on meta, parallelize it on ``parallel_dims`` (fp32 on CPU, bf16 on GPU),
    load the model state of ``checkpoint`` (a step-N folder, each rank its shards, after the ranks verify it
    together against its manifest; or a Hugging Face folder's safetensors) and put it in eval mode."""
    with torch.device("meta"):
        model = build_model(args, compute)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    parallelize_model(model, parallel_dims, ParallelizeOptions(param_dtype=dtype))
    model.to_empty(device=device)
    model.init_buffers(device)
    if weights_kind(checkpoint) == "hf":
        load_hf_weights(model, checkpoint)
        return model.eval()
    CheckpointManager(folder=os.path.dirname(checkpoint), model=model, optimizer=None, lr_scheduler=None,
                      dataloader=None, enable=False, interval=1).load_model_only(checkpoint, "--checkpoint")
    return model.eval()
