"""Convert a DCP checkpoint's weights to Hugging Face Llama format (config.json + model.safetensors).

Our RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head; Hugging Face's
rotates halves ``(x[i], x[i + Dh/2])``. The rows of wq and wk are permuted per head so
that both conventions compute the same attention.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ulysses.models.llama.args import LlamaArgs

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


def read_model_weights(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of a checkpoint, read without a process group."""
    metadata = FileSystemReader(checkpoint_dir).read_metadata()
    model = {
        key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{checkpoint_dir!r} holds no model weights")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": model}, checkpoint_id=checkpoint_dir, no_dist=True)
    return model


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder each head's output rows of a q/k projection from RoPE pairs ``(2i, 2i+1)`` to ``(i, i+Dh/2)``.

    Per head the rows become 0, 2, 4, ..., Dh-2, then 1, 3, ..., Dh-1: HF's ``rotate_half``
    then rotates exactly the pairs our ``apply_rope`` rotates, at the same frequencies, and
    q.k is unchanged because q and k are permuted alike.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _check_shapes(weights: dict[str, torch.Tensor], args: LlamaArgs) -> None:
    from titan_ulysses.models.llama.model import Transformer

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        shape = [k for k in expected.keys() & got.keys() if expected[k] != got[k]][:3]
        raise ValueError(
            f"the checkpoint does not match the model arguments given (flavor / overrides): "
            f"missing {missing}, unexpected {extra}, other shapes {shape}"
        )


def to_hf_state_dict(weights: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    _check_shapes(weights, args)
    out = {"model.embed_tokens.weight": weights["tok_embeddings.weight"], "model.norm.weight": weights["norm.weight"]}
    if not args.tie_embeddings:
        out["lm_head.weight"] = weights["output.weight"]
    for layer in range(args.n_layers):
        for ours, theirs in _LAYER_NAMES.items():
            w = weights[f"layers.{layer}.{ours}"]
            if ours == "attention.wq.weight":
                w = interleaved_to_halves(w, args.n_heads)
            elif ours == "attention.wk.weight":
                w = interleaved_to_halves(w, args.n_kv_heads)
            out[f"model.layers.{layer}.{theirs}"] = w
    return out


def hf_config(args: LlamaArgs, dtype: torch.dtype, max_position_embeddings: int = 131072) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "num_hidden_layers": args.n_layers,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),  # the key transformers >= 4.56 reads
    }
    if args.rope_scaling is not None:
        s = args.rope_scaling
        config["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return config


def export_hf(checkpoint_dir: str, args: LlamaArgs, output_dir: str, dtype: torch.dtype = torch.bfloat16,
              max_position_embeddings: int = 131072) -> None:
    """Write ``config.json`` and ``model.safetensors`` for ``transformers.LlamaForCausalLM``."""
    from safetensors.torch import save_file

    weights = read_model_weights(checkpoint_dir)
    state = {k: v.to(dtype).contiguous() for k, v in to_hf_state_dict(weights, args).items()}
    os.makedirs(output_dir, exist_ok=True)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(hf_config(args, dtype, max_position_embeddings), f, indent=2)
