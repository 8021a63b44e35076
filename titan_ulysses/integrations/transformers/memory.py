"""Memory options for a transformers model under ``apply_ulysses``: tiled MLPs and the fused head loss.

``tile_mlps(model, tile_size)`` runs every decoder layer's ``mlp`` module ``tile_size`` tokens at
a time with recompute (``ops/tiled.py``, Arctic Long Sequence Training's tiled MLP): only one
tile's intermediates (``[B, tile, ffn]``) exist at once, in forward and in backward. The MLP is
row-wise, so the numbers equal the untiled model's. Mixture-of-experts blocks are left alone
(their routers keep statistics over all tokens). Each MLP's class becomes a subclass of its own
with a tiled ``forward``: parameter names, ``state_dict`` and ``deepcopy`` are unchanged.

``fuse_head_loss(model, chunk_size)`` does to the model's own forward what Liger-Kernel's patches do
to each family's, for any decoder whose head is ``softcap(scale * hidden @ lm_head.weight.T)``:
called with ``shift_labels``, the forward asks transformers for no position's logits
(``logits_to_keep``), takes the backbone's last hidden state and returns ``.loss`` from the
project's fused linear cross-entropy (``ops/loss``: gradients in the forward, chunk by chunk), so
no ``[B, S/sp, V]`` logits exist at once; ``.logits`` is None. The loss follows transformers'
convention (the mean over this rank's label tokens, or the sum over ``num_items_in_batch``), so
``sp_loss(out.loss, shift_labels, mesh)`` takes it as it takes transformers' own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
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


def fused_loss_sum(model: nn.Module, hidden, labels, chunk_size: int, head: tuple | None = None):
    """Summed CE of ``model``'s head over ``hidden`` [B, S/sp, D] without its [B, S/sp, V] logits at once.

    ``head``: (scale, softcap), read from the config when None."""
    from titan_ulysses.ops import loss as loss_ops

    scale, softcap = _head_transform(model.config) if head is None else head
    weight = model.get_output_embeddings().weight
    hidden = hidden * scale if scale != 1.0 else hidden  # scale * (h @ W.T) == (scale * h) @ W.T
    return loss_ops.linear_cross_entropy_sum(hidden, weight, labels, chunk_size=chunk_size, ignore_index=-100,
                                             softcap=softcap)  # [] summed, fp32


@dataclasses.dataclass(frozen=True)
class FusedHead:
    """What ``fuse_head_loss`` computes the loss with: the head's transform, checked once, and the chunk."""

    scale: float
    """The factor on ``lm_head``'s output (Granite's 1 / logits_scaling, Cohere's logit_scale; 1.0: none)."""
    softcap: float | None
    """The final logit softcap (Gemma 2); None: none."""
    chunk_size: int
    """Tokens per chunk of the fused loss; 0: chosen from the shapes (``ops/loss`` ``auto_chunk_size``)."""


def _fused_class(cls: type) -> type:
    """A subclass of ``cls`` (a ``*ForCausalLM``) whose forward, given ``shift_labels``, returns the fused loss."""
    signature = inspect.signature(cls.forward)  # the model's own parameters (through transformers' decorators)
    var_kw = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)

    @functools.wraps(cls.forward)  # the same signature: apply_ulysses' pre-hook binds the call to it
    def forward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        extra = dict(arguments.get(var_kw, {}))
        shift = extra.pop("shift_labels", None)
        if shift is None:
            if arguments.get("labels") is not None:
                raise ValueError(f"{cls.__name__} under apply_ulysses(fused_loss=True): labels without shift_labels "
                                 f"would be shifted within this rank's slice; pass shift_labels=local['shift_labels'] "
                                 f"from shard_batch")
            return cls.forward(self, *args, **kwargs)  # no loss asked: transformers' logits, as without the option
        num_items = extra.pop("num_items_in_batch", None)
        as_tuple = extra.pop("return_dict", True) is False
        arguments["labels"] = None  # transformers computes no loss of its own (it would have no logits)
        arguments["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=shift.device)  # no position's logits
        arguments[var_kw] = extra
        seen = {}
        hook = self.base_model.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.last_hidden_state))
        try:
            out = cls.forward(*bound.args, **bound.kwargs)
        finally:
            hook.remove()
        if not dataclasses.is_dataclass(out):
            raise ValueError(f"{cls.__name__} under apply_ulysses(fused_loss=True) returned a tuple "
                             f"(config.return_dict False); set model.config.return_dict = True")
        if getattr(out, "aux_loss", None) is not None:
            raise ValueError(f"{cls.__name__} under apply_ulysses(fused_loss=True): output_router_logits adds a "
                             f"router loss of this rank's slice that the fused loss would drop; set it to False")
        head = self.ulysses_fused_head
        if hasattr(self.get_output_embeddings().weight, "full_tensor"):  # a DTensor: lm_head sharded on its own
            raise ValueError(f"{cls.__name__} under apply_ulysses(fused_loss=True): lm_head's weight is sharded "
                             f"outside the forward (fully_shard(lm_head) of its own); leave lm_head to the root's "
                             f"fully_shard(model)")
        if tuple(shift.shape) != tuple(seen["h"].shape[:2]):
            raise ValueError(f"{cls.__name__} under apply_ulysses(fused_loss=True): shift_labels "
                             f"{tuple(shift.shape)} for hidden states {tuple(seen['h'].shape[:2])}; pass "
                             f"shard_batch's shift_labels of this rank's slice")
        summed = fused_loss_sum(self, seen["h"], shift, head.chunk_size, (head.scale, head.softcap))  # [] fp32
        count = num_items if num_items is not None else (shift != -100).sum().clamp(min=1)  # transformers' convention
        loss = summed / count
        out = dataclasses.replace(out, loss=loss, logits=None)
        return out.to_tuple() if as_tuple else out

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "_fused_from": cls})


def fuse_head_loss(model: nn.Module, chunk_size: int = 0) -> None:
    """Give ``model``'s forward the fused head loss (see the module's docstring); refuse a head it cannot reproduce."""
    if chunk_size < 0:
        raise ValueError(f"apply_ulysses: loss_chunk_size={chunk_size}; give 0 (automatic) or a token count > 0")
    cls = type(model)
    base = cls.__dict__.get("_fused_from", cls)
    reason = fused_head_refusal(model)
    if reason is None and "logits_to_keep" not in inspect.signature(base.forward).parameters:
        reason = f"{base.__name__}'s forward takes no logits_to_keep, so it would compute every logit anyway"
    if reason is None and "forward" in vars(model):  # TRL's add_fused_lm_head, for one: it calls the class's own
        reason = (f"this {base.__name__}'s forward is replaced on the instance (TRL's add_fused_lm_head, for one), "
                  f"which would call the model's original forward and skip the fused loss; apply_ulysses first")
    if reason is None and getattr(model.config.get_text_config(), "output_router_logits", False):
        reason = (f"{base.__name__}'s config.output_router_logits adds a router loss to transformers' loss that the "
                  f"fused loss does not compute; set it to False")
    if reason:
        raise ValueError(f"apply_ulysses: fused_loss=True: {reason}; leave fused_loss off")
    scale, softcap = _head_transform(model.config)
    model.ulysses_fused_head = FusedHead(scale, softcap or None, chunk_size)
    if base is cls:
        model.__class__ = _fused_class(cls)
