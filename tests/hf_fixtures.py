"""Tiny Hugging Face model folders built with transformers itself (config.json + safetensors + tokenizer)."""

from __future__ import annotations

import json
import os

import torch

# model_type -> config keywords; small shapes, GQA everywhere
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=320, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # short original context: the scaling matters at 24 tokens
VARIANTS = {
    # name: (model_type, config overrides, save_pretrained max_shard_size or None for one file)
    "llama-untied-llama3rope": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0), None),
    "llama-tied-sharded": ("llama", dict(tie_word_embeddings=True, rope_theta=10000.0), "40KB"),
    # rope_theta neither transformers' default (10000) nor ours: a loader that drops it fails the logits
    "qwen3-tied-headdim": ("qwen3", dict(head_dim=16, tie_word_embeddings=True, rope_theta=2500.0), "40KB"),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False), None),
}


# one per family beyond Llama / Qwen: (model_type, config overrides, max_shard_size, sequence length)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 1.9, 3.7, 6.3]}
FAMILY_VARIANTS = {
    # Nemo's shape: head_dim 16 while dim / heads is 8; no window (v0.3, Nemo)
    "mistral-nemo-headdim": ("mistral", dict(head_dim=16, sliding_window=None, rope_theta=1e6), "40KB"),
    # a window shorter than the sequence (Mistral 7B v0.1, Ministral)
    "mistral-window": ("mistral", dict(sliding_window=7, tie_word_embeddings=True), None),
    # longrope beyond the original context (long factors), its attention factor, fused qkv / gate_up
    "phi3-longrope": ("phi3", dict(rope_scaling=LONGROPE, original_max_position_embeddings=16,
                                   max_position_embeddings=64, sliding_window=None, pad_token_id=0), None),
    # Phi-4-mini: partial rotary, tied, sharded files
    "phi4-partial-tied": ("phi3", dict(partial_rotary_factor=0.5, tie_word_embeddings=True, sliding_window=None,
                                       rope_theta=250000.0, pad_token_id=0), "40KB"),
    # Gemma 3: a sliding layer (window 7, local base) and a global one (linear scaling), q/k norms,
    # query_pre_attn_scalar, head_dim 16 != 64 / 8, (1 + w) norms, GeGLU, tied, scaled embeddings
    "gemma3-local-global": ("gemma3_text", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=7, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, max_position_embeddings=64), "40KB"),
    # Gemma 2: soft-capped scores and logits (caps low enough to bite), no q/k norms, one RoPE
    "gemma2-softcap": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
                                      attn_logit_softcapping=3.0, final_logit_softcapping=4.0, pad_token_id=0), None),
    # GLM-4: interleaved RoPE on half of each head (rows load in their own order), q/k/v biases, fused gate_up
    "glm-half-rotary-bias": ("glm", dict(head_dim=16, pad_token_id=0), "40KB"),
    # Qwen's long-context recipe: yarn with its attention factor
    "qwen3-yarn": ("qwen3", dict(head_dim=16, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 8},
                                 max_position_embeddings=32, rope_theta=10000.0), None),
}


def hf_classes(model_type: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "glm": (transformers.GlmConfig, transformers.GlmForCausalLM),
    }[model_type]


@torch.no_grad()
def randomize(model, seed: int = 0) -> None:
    """Weights far from the init: sharp attention (so RoPE order and scaling show), non-unit norms, biases."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif "q_proj" in name or "k_proj" in name or "qkv_proj" in name:
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_hf_model(folder: str, model_type: str, overrides: dict, max_shard_size=None, seed: int = 0, **extra):
    """Save a random model with ``save_pretrained`` and return it (fp32, eager attention)."""
    config_cls, model_cls = hf_classes(model_type)
    config = config_cls(**{**BASE, **overrides, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


TEXTS = [
    "The pass key is 12345. Remember it. 12345 is the pass key. What is the pass key?",
    "Grüße aus Zürich — naïve café, 東京 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 with emojis 🙂👍.",
    "def f(x):\n    return x  *  2\t\t# tabs, spaces    and 3.14159 digits 0 1 22 333 4444",
] * 4


def make_tokenizer(folder: str, vocab_size: int = 320, bos: bool = True) -> None:
    """A byte-level BPE tokenizer.json trained on a few strings, with tokenizer_config.json as the Hub has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 8, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end_of_text|>",
              "bos_token": "<|begin_of_text|>" if bos else None, "pad_token": None,
              "model_max_length": 131072}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
