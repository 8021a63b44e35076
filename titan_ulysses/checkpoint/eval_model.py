"""A checkpoint's model laid out as training lays it out, for evaluation (eval_needle, eval_long)."""

from __future__ import annotations

import os

import torch
from torch import nn

from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.models.llama.parallelize import ParallelizeOptions
from titan_ulysses.models.registry import build_model, parallelize_model


def load_eval_model(args, compute, parallel_dims, device: torch.device, checkpoint: str) -> nn.Module:
    """Build ``args``' family on meta, parallelize it on ``parallel_dims`` (fp32 on CPU, bf16 on GPU),
    load the model state of ``checkpoint`` (each rank its shards, after the ranks verify it together
    against its manifest) and put it in eval mode."""
    with torch.device("meta"):
        model = build_model(args, compute)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    parallelize_model(model, parallel_dims, ParallelizeOptions(param_dtype=dtype))
    model.to_empty(device=device)
    model.init_buffers(device)
    CheckpointManager(folder=os.path.dirname(checkpoint), model=model, optimizer=None, lr_scheduler=None,
                      dataloader=None, enable=False, interval=1).load_model_only(checkpoint, "--checkpoint")
    return model.eval()
