"""Does every module that mixes tokens go through transformers' attention interface?

Ulysses splits the sequence and gives attention the whole of it behind the all-to-all; any
other module that moves information between positions (a convolution, a state-space or
recurrent layer, linear attention) would see only its rank's slice and compute something
else. Acceptance is decided positively, not from a list of classes that fail: one probe
forward of a few tokens with attention replaced by a token-local function (its output at
position t reads only q, k, v at t), then, for every module whose input and output are
``[B, S, ...]`` hidden states, the gradient of its last position's output with respect to its
input at the other positions. Where it is not zero, that module mixes tokens outside
attention: the deepest such module is named in the refusal.
"""

from __future__ import annotations

import torch
from torch import nn

PROBE = "titan_ulysses_token_local_probe"
"""The name the token-local function is registered under in AttentionInterface during the probe."""

_TOKENS = 5


def _token_local(module, query, key, value, attention_mask, **kwargs):
    """Attention's shape and gradient paths, without mixing: out[t] depends on q, k, v at t only."""
    # query [B, Hq, S, D], key/value [B, Hkv, S, D] -> [B, S, Hq, Dv]
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    gate = (query * k).sum(-1, keepdim=True).sigmoid()
    return (v * gate).transpose(1, 2).contiguous(), None


def _hidden(x, tokens: int):
    """The first floating tensor of ``x`` (a tensor, tuple or dict) shaped [1, tokens, ...], else None."""
    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() and x.dim() >= 3 and x.shape[:2] == (1, tokens) else None
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    for item in items:
        found = _hidden(item, tokens)
        if found is not None:
            return found
    return None


def token_mixer(model: nn.Module) -> str | None:
    """``"name (Class)"`` of the deepest module of ``model`` that mixes tokens outside attention; None when none does.

    ``model`` must have real weights (not meta) and be on transformers' AttentionInterface.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE, _token_local)
    kernel, training = model.config._attn_implementation, model.training
    seen: list[tuple[str, nn.Module, torch.Tensor, torch.Tensor]] = []
    inputs: dict[int, torch.Tensor] = {}

    def pre(module, args, kwargs):
        x = _hidden(args, _TOKENS)
        x = x if x is not None else _hidden(kwargs, _TOKENS)
        if x is not None and x.requires_grad:
            inputs[id(module)] = x

    def post(name):
        def hook(module, args, kwargs, out):
            x, y = inputs.pop(id(module), None), _hidden(out, _TOKENS)
            if x is not None and y is not None and y.requires_grad:
                seen.append((name, module, x, y))
        return hook

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    try:
        model.set_attn_implementation(PROBE)
        model.eval()
        embed = model.get_input_embeddings()
        weight = embed.weight
        ids = torch.arange(_TOKENS, device=weight.device)[None] % embed.num_embeddings  # [1, T]
        with torch.enable_grad():
            embeds = embed(ids).detach().requires_grad_()  # [1, T, D]: grads flow even with frozen weights
            model(inputs_embeds=embeds, use_cache=False)
            mixers = []
            for name, module, x, y in seen:
                (g,) = torch.autograd.grad(y[:, -1].float().sum(), x, retain_graph=True, allow_unused=True)
                if g is not None and bool(g[:, :-1].abs().sum() > 0):  # [1, T-1, ...]: other positions
                    mixers.append((name, module))
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(kernel)
        model.train(training)
    if not mixers:
        return None
    name, module = max(mixers, key=lambda m: m[0].count("."))  # the deepest: the mixer itself, not its parents
    return f"{name} ({type(module).__name__})"
