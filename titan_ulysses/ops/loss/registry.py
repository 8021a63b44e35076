"""The loss-backend registry: the output projection + summed cross-entropy, and what each backend can do.

Adding a backend is one file (its function) and one :class:`LossBackend` entry in ``BACKENDS``. The
model's head calls :func:`linear_cross_entropy_sum`; config validation (:func:`check_loss_backend`,
before any process group), the planner and the GPU suite ask this table, never a backend's name.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from titan_ulysses.ops.loss.common import IGNORE_INDEX

PROFILE_RANGE = "titan_ulysses.loss"
"""The profiler range around the loss's forward (``benchmarks/profile_summary.py`` attributes by it)."""


@dataclass(frozen=True)
class LossBackend:
    name: str
    function: str
    """"module:function" taking ``(hidden [N, D], weight [V, D], labels [N], chunk_size, ignore_index, softcap)``."""
    package: str
    """The import it needs beyond torch ("" none), and the extra that installs it."""
    extra: str
    cuda_only: bool
    softcap: bool
    """Takes Gemma 2's final logit softcap."""
    chunk_size: bool
    """Honours ``model.loss_chunk_size`` (an override of the automatic chunk)."""
    summary: str


BACKENDS: dict[str, LossBackend] = {
    "fused": LossBackend("fused", "titan_ulysses.ops.loss.fused:fused_linear_cross_entropy_sum", "", "", False,
                         True, True, "gradients in forward, chunk by chunk; dW accumulated in fp32 on tensor cores"),
    "chunked": LossBackend("chunked", "titan_ulysses.ops.loss.chunked:chunked_linear_cross_entropy_sum", "", "",
                           False, False, True, "logits recomputed in backward, fp32 dW GEMM (the old default)"),
    "materialized": LossBackend("materialized",
                                "titan_ulysses.ops.loss.materialized:materialized_linear_cross_entropy_sum",
                                "", "", False, True, False, "all [N, V] logits at once"),
    "liger": LossBackend("liger", "titan_ulysses.ops.loss.liger:liger_linear_cross_entropy_sum", "liger_kernel",
                         "liger", True, True, False, "Liger-Kernel's fused linear cross-entropy, fp32 accumulation"),
    "cce": LossBackend("cce", "titan_ulysses.ops.loss.cce:cce_linear_cross_entropy_sum", "cut_cross_entropy",
                       "cce", True, True, False, "Apple's Cut Cross-Entropy"),
}


def get_loss_backend(name: str) -> LossBackend:
    if name not in BACKENDS:
        raise ValueError(f"model.loss_backend {name!r} is not one of {list(BACKENDS)}")
    return BACKENDS[name]


def loss_backend_problem(name: str, softcap: float | None = None, device_type: str | None = None) -> str:
    """Why ``name`` cannot run here ("" when it can): unknown, no CUDA, its package missing, no softcap."""
    if name not in BACKENDS:
        return f"model.loss_backend {name!r} is not one of {list(BACKENDS)}"
    b = BACKENDS[name]
    if softcap and not b.softcap:
        return (f"model.loss_backend {name!r} has no final logit softcap, which this model has "
                f"({softcap}); use one of {[x.name for x in BACKENDS.values() if x.softcap]}")
    if b.cuda_only and (device_type == "cpu" or not torch.cuda.is_available()):
        return (f"model.loss_backend {name!r} needs a CUDA GPU and none is visible; use one of "
                f"{[x.name for x in BACKENDS.values() if not x.cuda_only]}")
    if b.package and importlib.util.find_spec(b.package) is None:
        return (f"model.loss_backend {name!r} needs the {b.package} package: "
                f"pip install 'titan-ulysses[{b.extra}]' (or model.loss_backend fused)")
    return ""


def check_loss_backend(name: str, softcap: float | None = None, device_type: str | None = None) -> None:
    """Refuse a backend that cannot run here, in one line naming what to install or use (before any process group)."""
    problem = loss_backend_problem(name, softcap, device_type)
    if problem:
        raise ValueError(problem)


def _function(name: str):
    module, attr = get_loss_backend(name).function.split(":")
    return getattr(importlib.import_module(module), attr)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                             backend: str = "fused", chunk_size: int = 0, ignore_index: int = IGNORE_INDEX,
                             softcap: float | None = None) -> torch.Tensor:
    """Summed (not normalised) cross-entropy of ``softcap(hidden @ weight.T)`` against ``labels``.

    ``hidden: [..., D]``, ``weight: [V, D]``, ``labels: [...]``; an fp32 (fp64 for fp64 inputs) scalar.
    ``chunk_size`` 0: chosen from V, D and the token count (``common.auto_chunk_size``); > 0 overrides
    it for the backends that chunk. ``softcap``: Gemma 2's final logit softcap (None or 0: none).
    """
    fn = _function(backend)
    with torch.profiler.record_function(PROFILE_RANGE):
        return fn(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size, ignore_index,
                  softcap or None)
