"""Ulysses sequence parallelism for any transformers decoder, in the user's own training loop.

transformers routes attention through a registry, ``AttentionInterface``: every decoder that
supports it calls ``attention(module, query, key, value, attention_mask, **kwargs)`` on
``[B, H, S, D]`` tensors. :func:`apply_ulysses` registers one such function that wraps the
model's own kernel (``sdpa``, ``eager``, ``flash_attention_*``, ``flex_attention``) in
:class:`~titan_ulysses.distributed.ulysses.UlyssesAttention`, the exchange ``train.py`` uses
(uneven head counts, kv heads replicated up to the SP degree), and switches the model to it:

    q, k, v [B, H, S/P, D] -> all-to-all -> [B, H/P, S, D] -> the model's kernel -> all-to-all -> [B, S/P, H, D]

transformers builds its masks from the local sequence (S/P tokens); registered without a mask
builder, our function gets none and builds the mask of the *full* sequence with transformers'
own builders (``create_causal_mask`` / ``create_sliding_window_causal_mask``) from the full
sequence's positions: causal, the layer's ``sliding_window`` over global positions, and packed
documents (positions restarting at 0) exactly as one process would see them. A forward
pre-hook gathers those positions once per forward (one small all-gather) and passes them down
the model's ``**kwargs``; a rank's own ``position_ids`` stay global, so RoPE is right.
With ``head_stages=G`` the exchange runs in G checkpointed groups of heads (``staged.py``).

docs/transformers.md.
"""

from __future__ import annotations

import inspect
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_ulysses.distributed.ulysses import UlyssesAttention, check_heads

from .batch import _sp_mesh
from .memory import dense_mlps, fuse_head_loss, tile_mlps
from .mixing import token_mixer
from .staged import HeadStages, check_stages

__all__ = ["apply_ulysses"]

FULL_POSITIONS = "ulysses_full_position_ids"
"""The kwarg that carries the full sequence's positions [B, S] from the pre-hook to every attention call."""


def _refusal(model: nn.Module) -> str | None:
    """Why ``model``'s attention cannot be wrapped, in one line naming its class; None when it can."""
    from transformers import PreTrainedModel

    name = type(model).__name__
    if not isinstance(model, PreTrainedModel):
        return f"apply_ulysses: {name} is not a transformers PreTrainedModel"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return f"apply_ulysses: {name} is an encoder-decoder; Ulysses wraps causal decoder self-attention only"
    if not (model._supports_attention_backend and model._can_set_attn_implementation()):
        return (f"apply_ulysses: {name} does not route attention through transformers' AttentionInterface, "
                f"so its attention cannot be wrapped")
    for module in model.modules():
        if getattr(module, "is_causal", True) is False or getattr(module, "is_cross_attention", False):
            return (f"apply_ulysses: {name} has non-causal or cross-attention ({type(module).__name__}); "
                    f"Ulysses wraps causal decoder self-attention only")
    if str(config._attn_implementation).startswith("titan_ulysses"):
        return f"apply_ulysses: {name} is already under apply_ulysses ({config._attn_implementation})"
    if getattr(config, "num_attention_heads", None) is None:
        return f"apply_ulysses: {name}'s config has no num_attention_heads"
    if any(p.is_meta for p in model.parameters()):
        return (f"apply_ulysses: {name} has weights on the meta device; load or materialise them first "
                f"(one probe forward checks that only attention mixes tokens)")
    mixer = token_mixer(model)
    if mixer:
        return (f"apply_ulysses: {name}'s {mixer} mixes tokens outside transformers' attention interface "
                f"(a convolution, state-space or recurrent layer would see only its rank's slice); "
                f"only models whose every token-mixing layer is attention can be split")
    return None


class _LocalHeads:
    """The attention module as the kernel sees it after the exchange: its q/kv head ratio is this rank's, and
    its attention sinks (one per q head, which an eager kernel reads from ``module.sinks``) are this rank's."""

    def __init__(self, module: nn.Module, groups: int, sinks: torch.Tensor | None = None):
        self._module = module
        self.num_key_value_groups = groups
        if sinks is not None:
            self.sinks = sinks

    def __getattr__(self, name):
        return getattr(self._module, name)


class _KernelConfig:
    """The model's config, with the inner kernel's name and a layer's window: what transformers' mask builders read."""

    def __init__(self, config, kernel: str, window: int | None):
        self._config = config
        self._attn_implementation = kernel
        self.sliding_window = window
        self.is_causal = True

    def __getattr__(self, name):
        return getattr(self._config, name)


class _UlyssesFunction:
    """The function registered in ``AttentionInterface``: the exchange around ``kernel``."""

    def __init__(self, sp_mesh: DeviceMesh, kernel: str, head_stages: int = 1):
        self.kernel = kernel
        self.exchange = UlyssesAttention(self._local, sp_mesh)
        self.exchange.check_slices = False  # the pre-hook checks the slice lengths once per forward
        if head_stages > 1:  # staged.py: the same exchange, G groups of heads one after another
            self.exchange = HeadStages(self.exchange, head_stages)
        self._masks: tuple = (None, {})  # (the full positions they were built for, {(window, dtype): mask})

    def _kernel_fn(self, module):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.kernel == "eager":  # each model file has its own (softcapping, sinks, ...)
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise ValueError(f"{type(module).__name__}: no eager_attention_forward in its module; "
                                 f"load the model with attn_implementation='sdpa' before apply_ulysses")
            return fn
        return ALL_ATTENTION_FUNCTIONS[self.kernel]

    def _mask(self, module, full_pos: torch.Tensor, window, dtype, device):
        """The mask of the full sequence for ``self.kernel``, as transformers builds it for one process."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        built_for, masks = self._masks
        if built_for is not full_pos:  # a new forward (an AC recompute passes the same tensor again)
            masks = {}
            self._masks = (full_pos, masks)
        key = (window, dtype)
        if key not in masks:
            embeds = torch.empty(*full_pos.shape, 0, dtype=dtype, device=device)  # [B, S, 0]: shape and dtype only
            config = _KernelConfig(module.config, self.kernel, window)
            build = create_sliding_window_causal_mask if window else create_causal_mask
            masks[key] = build(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                               position_ids=full_pos)
        return masks[key]

    def _local(self, q, k, v, module, mask, kwargs, sinks=None):
        # q: [B, S, Hq_r, D], k/v: [B, S, Hkv_r, D] -> the kernel's [B, H, S, D]
        if sinks is not None:
            kwargs = {**kwargs, "s_aux": sinks}
        heads = _LocalHeads(module, q.shape[2] // k.shape[2], sinks)
        out, _ = self._kernel_fn(module)(heads, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, **kwargs)
        return out  # [B, S, Hq_r, D]

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        # query: [B, Hq, S/P, D], key/value: [B, Hkv, S/P, D]
        name = type(module).__name__
        full_pos = kwargs.pop(FULL_POSITIONS, None)
        if full_pos is None:
            raise ValueError(f"{name}: no full-sequence positions; call the model apply_ulysses was given "
                             f"(its forward pre-hook provides them), not a submodule")
        if attention_mask is not None or query.shape[2] != key.shape[2]:
            raise ValueError(f"{name}: under apply_ulysses attention takes no mask or cache (got "
                             f"{'a mask' if attention_mask is not None else 'a cache'}); pass padding as ignored "
                             f"labels (shard_batch does) and use_cache=False")
        for unused in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            if kwargs.get(unused) is not None:
                raise ValueError(f"{name}: {unused} describe one rank's slice; pass packed documents as "
                                 f"position_ids restarting at 0 (shard_batch keeps them global)")
        kwargs["position_ids"] = full_pos  # flash kernels find packed documents in them
        mask = self._mask(module, full_pos, kwargs.get("sliding_window"), query.dtype, query.device)
        sinks = kwargs.pop("s_aux", None)
        out = self.exchange(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                            module, mask, kwargs, sinks=sinks)  # [B, S/P, Hq, D]
        return out, None


def _positions_hook(sp_mesh: DeviceMesh):
    """A forward pre-hook: global ``position_ids`` for this rank's tokens, and the full sequence's for attention.

    No host read: the slice lengths are compared on the device (``_assert_async``), the full
    positions stay on the device (one all-gather when the caller passes ``position_ids``, none
    when it does not: they are then 0..S-1), and the forward's signature is read once per class.
    """
    sp, rank, group = sp_mesh.size(), sp_mesh.get_local_rank(), sp_mesh.get_group()
    signatures: dict[type, tuple[inspect.Signature, str]] = {}

    def hook(module, args, kwargs):
        cls = type(module)
        if cls not in signatures:  # the class's forward: accelerate may wrap the instance's in (*args, **kwargs)
            signature = inspect.signature(cls.forward)
            var_kw = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
            signatures[cls] = (signature, var_kw)
        signature, var_kw = signatures[cls]
        bound = signature.bind(module, *args, **kwargs)
        arguments = bound.arguments
        extra = arguments.get(var_kw, {})  # the **kwargs transformers passes down to attention
        ids = arguments.get("input_ids")
        ids = ids if ids is not None else arguments["inputs_embeds"]
        b, s_local = ids.shape[:2]
        if arguments.get("cache") is not None or arguments.get("past_key_values") is not None:
            raise ValueError(f"{cls.__name__} under apply_ulysses: no cache (training forward only)")
        mask = arguments.get("attention_mask")
        if mask is not None:  # only when the caller passes one: shard_batch returns none
            if tuple(mask.shape) != (b, s_local) or not bool(mask.all()):
                raise ValueError(f"{cls.__name__} under apply_ulysses: attention_mask of shape {tuple(mask.shape)} "
                                 f"with padding or not [batch, S/sp]; shard_batch turns padding into ignored labels "
                                 f"and returns no mask")
            arguments["attention_mask"] = None
        lengths = torch.empty(sp, dtype=torch.int64, device=ids.device)
        dist.all_gather_into_tensor(lengths, torch.tensor([s_local], device=ids.device), group=group)
        torch._assert_async((lengths == s_local).all(), "apply_ulysses: the sp ranks hold slices of different "
                            "lengths; every rank must hold S/sp tokens (shard_batch pads S to a multiple of sp)")
        positions = arguments.get("position_ids")
        if positions is None:  # global positions of this rank's tokens; the full sequence's are 0..S-1
            positions = torch.arange(rank * s_local, (rank + 1) * s_local, device=ids.device)[None].expand(b, s_local)
            full = torch.arange(sp * s_local, device=ids.device)[None].expand(b, sp * s_local)  # [B, S]
        else:
            positions = positions.expand(b, s_local)  # [B, S/P]
            gathered = positions.new_empty(sp * b, s_local)  # [P * B, S/P]: rank j's block j
            dist.all_gather_into_tensor(gathered, positions.contiguous(), group=group)
            full = gathered.view(sp, b, s_local).transpose(0, 1).reshape(b, sp * s_local)  # [B, S]
        arguments["position_ids"] = positions
        if "use_cache" in signature.parameters:
            arguments["use_cache"] = False
        arguments[var_kw] = {**extra, FULL_POSITIONS: full}
        return bound.args[1:], bound.kwargs

    return hook


def option_refusal(caller: str, mlp_tile_size=0, head_stages=1, fused_loss=False, loss_chunk_size=0) -> str | None:
    """Why the memory options' types or ranges are wrong, in one line naming ``caller``'s option; None when right."""
    def whole(v, low):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    for name, value, low, meaning in (("mlp_tile_size", mlp_tile_size, 0, "0 = off"),
                                      ("head_stages", head_stages, 1, "1 = off"),
                                      ("loss_chunk_size", loss_chunk_size, 0, "0 = automatic")):
        if not whole(value, low):
            return f"{caller}: {name} must be an integer >= {low} ({meaning}), got {value!r}"
    if not isinstance(fused_loss, bool):
        return f"{caller}: fused_loss={fused_loss!r} must be True or False"
    return None


def apply_ulysses(model: nn.Module, mesh: DeviceMesh, sp_dim: str = "sp", mlp_tile_size: int = 0,
                  head_stages: int = 1, fused_loss: bool = False, loss_chunk_size: int = 0) -> nn.Module:
    """Switch ``model`` (a transformers decoder) to Ulysses over the ``sp_dim`` dim of ``mesh``.

    Registers a function in transformers' ``AttentionInterface`` wrapping the model's current
    kernel (``config._attn_implementation``), sets the model to it and adds a forward pre-hook
    for the positions. Call it before ``fully_shard``, activation checkpointing and compile;
    feed the model :func:`shard_batch`'s slices. Returns ``model``.

    ``mlp_tile_size`` > 0 runs every dense MLP that many tokens at a time with recompute
    (``memory.tile_mlps``): off by default, exact against the untiled model.
    ``head_stages`` > 1 runs each attention in that many groups of heads, each exchanged, attended
    and checkpointed on its own (``staged.py``): one group's full-sequence q/k/v/out alive at a time.
    ``fused_loss``: called with ``shift_labels``, the model returns ``.loss`` (this rank's token
    mean) from the project's fused linear cross-entropy over ``lm_head`` (its logit scale and
    softcap applied) and no logits (``memory.fuse_head_loss``); ``loss_chunk_size`` > 0 overrides
    its automatic chunk. A head it cannot reproduce (checked on a 4-token forward) is refused.
    """
    reason = option_refusal("apply_ulysses", mlp_tile_size, head_stages, fused_loss, loss_chunk_size) or _refusal(model)
    if reason:
        raise ValueError(reason)
    from transformers import AttentionInterface

    sp_mesh = _sp_mesh(mesh, sp_dim)
    if mlp_tile_size > 0 and not dense_mlps(model):
        raise ValueError(f"apply_ulysses: mlp_tile_size={mlp_tile_size} but {type(model).__name__} has no dense "
                         f"`mlp` module (class name ending in MLP) to tile; leave mlp_tile_size at 0")
    if sp_mesh.size() == 1:
        raise ValueError(f"apply_ulysses: the mesh's {sp_dim!r} dim has size 1, nothing to split; run the model "
                         f"without apply_ulysses, or give {sp_dim!r} 2 or more ranks")
    config = model.config
    n_heads = config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    check_heads(n_heads, n_kv_heads, sp_mesh.size(), 1)
    check_stages(head_stages, n_heads, n_kv_heads, sp_mesh.size())
    if loss_chunk_size and not fused_loss:
        raise ValueError(f"apply_ulysses: loss_chunk_size={loss_chunk_size} sets the fused loss's chunk; add "
                         f"fused_loss=True or leave loss_chunk_size at 0")
    if fused_loss:  # before the switch: its check runs one plain forward
        fuse_head_loss(model, loss_chunk_size)
    kernel = config._attn_implementation
    staged = f"_stages{head_stages}" if head_stages > 1 else ""
    name = f"titan_ulysses_{kernel}_sp{sp_mesh.size()}{staged}_{sp_mesh.get_group().group_name}"
    AttentionInterface.register(name, _UlyssesFunction(sp_mesh, kernel, head_stages))
    model.set_attn_implementation(name)
    model.register_forward_pre_hook(_positions_hook(sp_mesh), with_kwargs=True)
    tile_mlps(model, mlp_tile_size)
    return model
