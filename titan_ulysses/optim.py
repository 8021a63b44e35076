"""AdamW and the warmup-stable-decay learning-rate schedule; ``build_optimizers`` makes both from a job's config."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

DECAY_TYPES = ("linear", "cosine", "sqrt")


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float, eps: float,
                    betas: tuple[float, float], device_type: str) -> torch.optim.Optimizer:
    if name.lower() != "adamw":
        raise ValueError(f"optimizer.name {name!r} is not supported; use 'AdamW'")
    # Fused kernels where PyTorch has them (CUDA and CPU): one pass over each parameter and its
    # state, no temporaries. On CPU, foreach (multi-tensor) makes a full-size temporary list per op:
    # it was most of what our step cost beyond a bare loop (scripts/bench_step_overhead.py).
    impl = {"fused": True} if device_type in ("cuda", "cpu") else {"foreach": True}
    # frozen parameters (the LoRA base) get no optimizer state
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl)


def wsd_factor(step: int, total_steps: int, warmup_steps: int, decay_ratio: float,
               decay_type: str, min_lr_factor: float) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, constant, then a final decay.

    ``decay_ratio`` is the fraction of ``total_steps`` spent decaying at the end (0: none).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_steps = round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if decay_steps == 0 or step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"lr_scheduler.decay_type {decay_type!r} is not one of {list(DECAY_TYPES)}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer, total_steps: int, warmup_steps: int, decay_ratio: float,
                       decay_type: str, min_lr_factor: float) -> LambdaLR:
    def factor(step: int) -> float:
        return wsd_factor(step, total_steps, warmup_steps, decay_ratio, decay_type, min_lr_factor)

    return LambdaLR(optimizer, factor)


def apply_hyperparameters(optimizer, lr_scheduler: LambdaLR, lr: float, weight_decay: float, eps: float,
                          betas: tuple[float, float]) -> None:
    """Make a restored optimizer and schedule follow the config: on resume what the user sets wins.

    Loading a checkpoint brings back the param groups (lr, betas, eps, weight decay) and the
    scheduler's ``base_lrs`` as they were saved, which would silently override the command
    line. The schedule keeps its restored step count (``last_epoch``); its shape is the
    config's (the lambda is built from it, never saved), and its peak is ``lr``.
    """
    for group in optimizer.param_groups:
        group.update(initial_lr=lr, weight_decay=weight_decay, eps=eps, betas=betas)
    lr_scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    lrs = [lr * fn(lr_scheduler.last_epoch) for fn in lr_scheduler.lr_lambdas]
    for group, value in zip(optimizer.param_groups, lrs):
        group["lr"] = value
    lr_scheduler._last_lr = lrs


def build_optimizers(config, model: nn.Module, device: torch.device) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The optimizer (``[optimizer]``) and its schedule (``[lr_scheduler]``, over ``training.steps``).
    With FSDP CPU offload the optimizer steps on host-resident shards, so it is built for the host."""
    o, s, t = config.optimizer, config.lr_scheduler, config.training
    optimizer = build_optimizer(model, o.name, o.lr, o.weight_decay, o.eps, (o.beta1, o.beta2),
                                "cpu" if t.enable_cpu_offload else device.type)
    return optimizer, build_lr_scheduler(optimizer, t.steps, s.warmup_steps, s.decay_ratio, s.decay_type,
                                         s.min_lr_factor)


def follow_config(optimizer, lr_scheduler: LambdaLR, config) -> None:
    """After a resume: the config's ``[optimizer]`` settings over the restored ones (:func:`apply_hyperparameters`)."""
    o = config.optimizer
    apply_hyperparameters(optimizer, lr_scheduler, o.lr, o.weight_decay, o.eps, (o.beta1, o.beta2))
