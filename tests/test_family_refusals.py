"""What no family here trains exactly is refused from config.json alone, in one line naming the field."""

import pytest
import torch

from titan_ulysses.interop.hf_config import HFConfigError, args_from_hf_config

BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=128, vocab_size=320, max_position_embeddings=4096)


@pytest.mark.parametrize("cfg, message", [
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "model_type 'deepseek_v3' is a mixture-of-experts "
                                                             "model (n_routed_experts 256) with multi-head latent "
                                                             "attention: not supported (mixtures of experts here: "
                                                             "gpt_oss, mixtral, qwen3_moe)"),
    ({"model_type": "qwen3_next", "num_experts": 512}, "model_type 'qwen3_next' is a mixture-of-experts model "
                                                       "(num_experts 512) with linear-attention (Gated DeltaNet) layers"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "capacity_factor": 1.25}, "config.json capacity_factor 1.25: expert capacity drops tokens, so the result would "
                                "depend on how tokens are batched and laid out"),
    ({"model_type": "mixtral", "num_local_experts": 8, "router_jitter_noise": 0.01},
     "config.json router_jitter_noise 0.01: random router noise is not supported; set it to 0"),
    ({"model_type": "gpt_oss", "num_local_experts": 8, "num_experts_per_tok": 2,
      "quantization_config": {"quant_method": "mxfp4"}}, "quantization_config 'mxfp4': the experts are quantized; "
                                                         "use a dequantised (bf16) gpt-oss folder"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
     "layer_types contains 'linear_attention': state-space / linear-attention layers are not supported"),
    ({"model_type": "jamba", "mamba_d_state": 16}, "mamba_d_state 16: state-space / linear-attention layers"),
    ({"model_type": "falcon_mamba"}, "model_type 'falcon_mamba': state-space / linear-attention layers"),
    ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported (one of ['gemma2', 'gemma3_text', 'glm', "
                                 "'gpt_oss', 'llama', 'mistral', 'mixtral', 'phi3', 'qwen2', 'qwen3', 'qwen3_moe'])"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for model_type 'llama' (silu)"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias True is not supported for model_type 'llama'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16},
     "use_sliding_window true (sliding_window 16): sliding-window attention on Qwen layers is not supported"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
     "rope_scaling longrope needs short_factor and long_factor"),
])
def test_refusal_names_the_field(cfg, message):
    with pytest.raises(HFConfigError) as e:
        args_from_hf_config({**BASE, **cfg})
    line = str(e.value)
    assert line.startswith(message) and "\n" not in line, line


def test_mistral_window_defaults_as_transformers():
    """MistralConfig's default window (4096) applies when config.json has no sliding_window key; null is none."""
    assert args_from_hf_config({**BASE, "model_type": "mistral"}).sliding_window == 4096
    assert args_from_hf_config({**BASE, "model_type": "mistral", "sliding_window": None}).sliding_window == 0
    assert args_from_hf_config({**BASE, "model_type": "phi3"}).sliding_window == 0


def test_a_backend_without_windows_or_softcap_is_refused_by_name(monkeypatch):
    """Before any process group: the backend must take window= / softcap= where the model needs them."""
    from titan_ulysses.models.registry import check_compute
    from titan_ulysses.ops import attention

    windowed = args_from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 16})
    gemma2 = args_from_hf_config({**BASE, "model_type": "gemma2", "head_dim": 16, "sliding_window": 0})
    check_compute(args_from_hf_config({**BASE, "model_type": "mistral", "sliding_window": None}), "sdpa")
    plain = attention.SDPAAttention
    if "window" not in __import__("inspect").signature(plain.forward).parameters:
        with pytest.raises(ValueError, match="^model.attn_backend 'sdpa' cannot compute mistral's sliding_window 16 "):
            check_compute(windowed, "sdpa")
    if "softcap" not in __import__("inspect").signature(plain.forward).parameters:
        with pytest.raises(ValueError, match="^model.attn_backend 'sdpa' cannot compute gemma2's "
                                             "attn_logit_softcapping 50.0"):
            check_compute(gemma2, "sdpa")

    class Capable(torch.nn.Module):  # a backend that takes both passes
        def forward(self, q, k, v, attention_mask=None, *, scale=None, window=0, softcap=0.0):
            return q

    monkeypatch.setattr(attention, "build_attention", lambda *a, **k: Capable())
    check_compute(windowed, "sdpa")
    check_compute(gemma2, "sdpa")
