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


def _head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) the model applies to ``lm_head``'s output, from its config's usual fields."""
    text = config.get_text_config()
    scale = next((getattr(text, k) for k in ("logit_scale", "output_multiplier", "lm_head_multiplier")
                  if getattr(text, k, None) is not None), None)
    if scale is None and getattr(text, "logits_scaling", None):
        scale = 1.0 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def fused_head_refusal(model: nn.Module) -> str | None:
    """Why the fused loss cannot stand in for ``model``'s head, checked on a 4-token forward; None when it can.

    Positive: the logits the model computes must equal ``softcap(scale * hidden @ lm_head.weight.T)``
    from its backbone's last hidden state; any other head (a bias, another transform) is refused.
    """
    import torch

    head, backbone = model.get_output_embeddings(), model.base_model
    if head is None or getattr(head, "bias", None) is not None or backbone is model:
        return f"{type(model).__name__}: no bias-free lm_head over a backbone for the fused loss to replace"
    scale, softcap = _head_transform(model.config)
    seen = {}
    handle = backbone.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.last_hidden_state))
    try:
        with torch.no_grad():
            ids = torch.arange(4, device=head.weight.device)[None] % head.weight.shape[0]
            logits = model(input_ids=ids, use_cache=False).logits.float()
    finally:
        handle.remove()
    mine = (seen["h"].float() @ head.weight.float().T) * scale
    if softcap:
        mine = softcap * torch.tanh(mine / softcap)
    if not torch.allclose(mine, logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max())):
        return (f"{type(model).__name__}'s head computes its logits in a way the fused loss does not reproduce "
                f"(not softcap(scale * hidden @ lm_head.weight.T))")
    return None


def fused_loss_sum(model: nn.Module, hidden, labels, chunk_size: int):
    """Summed CE of ``model``'s head over ``hidden`` [B, S/sp, D] without its [B, S/sp, V] logits at once."""
    from titan_ulysses.ops import loss as loss_ops

    scale, softcap = _head_transform(model.config)
    weight = model.get_output_embeddings().weight
    hidden = hidden * scale if scale != 1.0 else hidden  # scale * (h @ W.T) == (scale * h) @ W.T
    return loss_ops.linear_cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size, ignore_index=-100,
                                             softcap=softcap)  # [] summed, fp32
