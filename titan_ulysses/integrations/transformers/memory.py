"""Memory options for a transformers model under ``apply_ulysses``: the project's tiled MLP on the model's own MLPs.

``tile_mlps(model, tile_size)`` runs every decoder layer's ``mlp`` module ``tile_size`` tokens at
a time with recompute (``ops/tiled.py``, Arctic Long Sequence Training's tiled MLP): only one
tile's intermediates (``[B, tile, ffn]``) exist at once, in forward and in backward. The MLP is
row-wise, so the numbers equal the untiled model's. Mixture-of-experts blocks are left alone
(their routers keep statistics over all tokens). Each MLP's class becomes a subclass of its own
with a tiled ``forward``: parameter names, ``state_dict`` and ``deepcopy`` are unchanged.
"""

from __future__ import annotations

from torch import nn

from titan_ulysses.ops.tiled import tiled_apply


def dense_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``*.mlp`` modules whose class name ends in ``MLP`` (dense, row-wise)."""
    return [(name, m) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] == "mlp" and type(m).__name__.endswith("MLP")]


def _tiled_class(cls: type) -> type:
    def forward(self, x):  # x: [B, S/sp, D]
        return tiled_apply(self, lambda t: cls.forward(self, t), x, self.mlp_tile_size)

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "_tiled_from": cls})


def tile_mlps(model: nn.Module, tile_size: int) -> list[str]:
    """Tile every dense MLP of ``model`` (``tile_size`` > 0); returns their names."""
    if tile_size <= 0:
        return []
    mlps = dense_mlps(model)
    if not mlps:
        raise ValueError(f"apply_ulysses: mlp_tile_size={tile_size} but {type(model).__name__} has no dense `mlp` "
                         f"module (class name ending in MLP) to tile; leave mlp_tile_size at 0")
    classes: dict[type, type] = {}
    for _, module in mlps:
        cls = type(module)
        if "_tiled_from" not in cls.__dict__:
            module.__class__ = classes.setdefault(cls, _tiled_class(cls))
        module.mlp_tile_size = tile_size
    return [name for name, _ in mlps]
