"""float8 training through torchao: every block's linear layers compute in float8.

``apply_float8`` swaps ``nn.Linear`` modules for torchao's ``Float8Linear`` (dynamic
scaling) before the other parallelisms are applied; the output layer is kept in high
precision, as are layers whose sizes the float8 matmul cannot take (multiples of 16).

* ``tensorwise``: one scale per tensor. With FSDP the weights are all-gathered already
  in float8 (half the bytes of bf16); their scales come from one all-reduced amax per
  parameter, computed for all parameters at once after each optimizer step
  (:func:`precompute_float8_scales`).
* ``rowwise``: one scale per row, more accurate, all-gathered in high precision.

The float8 matmul needs an NVIDIA GPU of compute capability 8.9 or newer (H100, L4, Ada).
``emulate`` runs the same casts and scales with a high-precision matmul, on any device:
that is how CPU tests check the wiring, not a way to get speed.

Numerics: tensorwise activation scales come from each rank's own slice of the sequence,
so a Ulysses run quantizes slightly differently from a single-device run; it is equal to
it within float8 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")


@dataclass
class Float8Options:
    recipe: str = "tensorwise"
    """"tensorwise" or "rowwise" scaling."""
    emulate: bool = False
    """Emulate the float8 matmul in high precision (tests, CPU); no speedup."""
    fsdp_float8_all_gather: bool = True
    """tensorwise only: FSDP all-gathers weights in float8."""
    exclude: tuple[str, ...] = ("output",)
    """Module names (fully qualified) kept in high precision."""


def _import_torchao():
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError(
            "float8.enable needs torchao: pip install 'titan_ulysses[float8]'"
        ) from e
    return float8


def float8_options(config) -> Float8Options | None:
    """The float8 settings of ``config`` (a JobConfig) for ``parallelize_decoder``; None when float8 is off."""
    f = config.float8
    if not f.enable:
        return None
    return Float8Options(recipe=f.recipe, emulate=f.emulate, fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather)


def check_float8(options: Float8Options, tp: int) -> None:
    """Refuse float8 settings this machine or layout cannot run; call before any process group."""
    if options.recipe not in RECIPES:
        raise ValueError(f"float8.recipe {options.recipe!r} is not one of {list(RECIPES)}")
    if tp > 1:
        raise ValueError(
            f"float8.enable with tensor_parallel_degree {tp} is not supported (torchao's float8 "
            f"tensor-parallel styles are not wired in); use tensor_parallel_degree 1"
        )
    _import_torchao()
    if options.emulate:
        return
    if not torch.cuda.is_available():
        raise ValueError(
            "float8.enable needs an NVIDIA GPU of compute capability >= 8.9 and none is visible; "
            "set float8.emulate = true to run the float8 numerics in emulation (no speedup)"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(
            f"float8.enable needs compute capability >= 8.9 (H100, L4, Ada); this GPU has {major}.{minor}. "
            f"Set float8.enable = false, or float8.emulate = true for emulation"
        )


def _config(options: Float8Options):
    float8 = _import_torchao()
    if options.recipe == "rowwise":
        config = float8.Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=options.fsdp_float8_all_gather)
    return replace(config, emulate=options.emulate)


def apply_float8(model: nn.Module, options: Float8Options) -> int:
    """Convert eligible ``nn.Linear`` modules of ``model`` to float8 in place; returns how many."""
    float8 = _import_torchao()

    def eligible(module: nn.Module, fqn: str) -> bool:
        if fqn in options.exclude or not isinstance(module, nn.Linear):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    float8.convert_to_float8_training(model, config=_config(options), module_filter_fn=eligible)
    from torchao.float8.float8_linear import Float8Linear

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def precompute_float8_scales(model: nn.Module, options: Float8Options | None) -> None:
    """After ``optimizer.step()``: one all-reduce for the float8 scales of every FSDP weight."""
    if options is None or options.recipe != "tensorwise" or not options.fsdp_float8_all_gather:
        return
    _import_torchao().precompute_float8_dynamic_scale_for_fsdp(model)
