"""State-dict adapter between our names / RoPE layout and Hugging Face's, both ways, per family.

Our RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face's
rotates halves ``(x[i], x[i + Dh/2])``. Everything that lays out a head's features along
q or k is therefore permuted per head: the rows of wq and wk, the q/k biases (Qwen2) and
the per-head q/k norm weights (Qwen3, one "head" of Dh entries). v and o are not rotated
and keep their order. The families differ only in which of these tensors exist
(``args.qkv_bias``, ``args.qk_norm``, ``args.tie_embeddings``), so one table serves all.
"""

from __future__ import annotations

import torch

from titan_ulysses.models.llama.args import LlamaArgs

# ours -> theirs, per layer, for tensors that every family has
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BIAS_NAMES = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
_QK_NORM_NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}


def _rope_heads(args: LlamaArgs) -> dict[str, int]:
    """Per-layer names whose leading dim is RoPE-ordered, with the number of heads it holds."""
    heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads}
    if args.qkv_bias:
        heads.update({"attention.wq.bias": args.n_heads, "attention.wk.bias": args.n_kv_heads})
    if args.qk_norm:
        heads.update({"attention.q_norm.weight": 1, "attention.k_norm.weight": 1})
    return heads


def name_map(args: LlamaArgs) -> dict[str, tuple[str, int]]:
    """Our fully-qualified name -> (Hugging Face name, heads to permute per RoPE layout or 0)."""
    out = {"tok_embeddings.weight": ("model.embed_tokens.weight", 0), "norm.weight": ("model.norm.weight", 0)}
    if not args.tie_embeddings:
        out["output.weight"] = ("lm_head.weight", 0)
    layer_names = dict(_LAYER_NAMES)
    if args.qkv_bias:
        layer_names.update(_BIAS_NAMES)
    if args.qk_norm:
        layer_names.update(_QK_NORM_NAMES)
    heads = _rope_heads(args)
    for layer in range(args.n_layers):
        for ours, theirs in layer_names.items():
            out[f"layers.{layer}.{ours}"] = (f"model.layers.{layer}.{theirs}", heads.get(ours, 0))
    return out


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's rows (of a q/k weight, bias or norm weight) from RoPE pairs ``(2i, 2i+1)`` to ``(i, i+Dh/2)``.

    Per head the rows become 0, 2, 4, ..., Dh-2, then 1, 3, ..., Dh-1: HF's ``rotate_half``
    then rotates exactly the pairs our ``apply_rope`` rotates, at the same frequencies, and
    q.k is unchanged because q and k are permuted alike.
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves` (Hugging Face's layout to ours)."""
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(w.shape)


def to_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our full (unsharded) weights -> Hugging Face names and layout."""
    out = {}
    for ours, (theirs, heads) in name_map(args).items():
        w = state[ours]
        out[theirs] = interleaved_to_halves(w, heads) if heads else w
    return out


def from_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Hugging Face full weights -> our names and layout (extra keys, e.g. a tied lm_head, are ignored)."""
    out = {}
    for ours, (theirs, heads) in name_map(args).items():
        w = state[theirs]
        out[ours] = halves_to_interleaved(w, heads) if heads else w
    return out


def expected_hf_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape for a model of ``args`` (built on the meta device, no memory)."""
    from titan_ulysses.models.llama.model import Transformer

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    return {theirs: shapes[ours] for ours, (theirs, _) in name_map(args).items()}
