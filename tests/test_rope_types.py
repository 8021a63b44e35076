"""RoPE types read from config.json give transformers' own frequencies and attention factor.

For each type the same config.json dict goes to transformers (``ROPE_INIT_FUNCTIONS``, the
functions its models call) and to ``args_from_hf_config``; our model's buffer and factor
must match. Settings are chosen so every branch matters (yarn's ramp covers several dims,
truncate changes the range, mscale / attention_factor override, longrope's long factors).
"""

import pytest
import torch

from titan_ulysses.interop.hf_config import HFConfigError, args_from_hf_config
from titan_ulysses.models.rope import rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=128, vocab_size=320, max_position_embeddings=4096)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
LONG = [1.0 + 0.1 * i for i in range(32)]
SHORT = [1.0 + 0.01 * i for i in range(32)]
CASES = {
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}}),
    "llama3": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
                                             "rope_theta": 500000.0}}),
    "yarn": ("qwen3", {"rope_parameters": YARN, "max_position_embeddings": 4096, "head_dim": 64}),
    "yarn-no-truncate": ("qwen3", {"rope_parameters": {**YARN, "truncate": False}, "head_dim": 64}),
    "yarn-mscale": ("llama", {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16,
                                                  "beta_slow": 2}}),
    "yarn-attention-factor": ("mistral", {"rope_parameters": {**YARN, "attention_factor": 1.3}}),
    # the Hub's spelling: rope_theta + rope_scaling with "type"
    "yarn-old-keys": ("qwen2", {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                     "original_max_position_embeddings": 1024}}),
    "longrope": ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                          "original_max_position_embeddings": 1024, "max_position_embeddings": 8192}),
    "longrope-partial": ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": SHORT[:24],
                                                   "long_factor": LONG[:24]}, "partial_rotary_factor": 0.75,
                                  "original_max_position_embeddings": 1024, "max_position_embeddings": 8192}),
}


def _hf_config(model_type, cfg):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **cfg})
    return config


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_attention_factor_match_transformers(name):
    model_type, extra = CASES[name]
    config = _hf_config(model_type, extra)
    rope_type = config.rope_parameters["rope_type"]
    args = args_from_hf_config({"model_type": model_type, **BASE, **extra})
    assert args.rope_scaling is not None and args.rope_scaling.rope_type == rope_type
    lengths = [None] if rope_type != "longrope" else [None, 1024, 1025]
    for seq_len in lengths:
        theirs, theirs_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
        long = seq_len is not None and seq_len > args.rope_scaling.original_max_position_embeddings
        ours, factor = rope_frequencies(args.rotary_dim, args.rope_theta, args.rope_scaling, long=long)
        assert ours.shape == theirs.shape, name
        torch.testing.assert_close(ours, theirs.float(), rtol=2e-6, atol=0, msg=f"{name} inv_freq ({seq_len})")
        assert factor == pytest.approx(theirs_factor, rel=1e-9), name
    # the model's buffers are these frequencies (longrope: short and long both)
    from titan_ulysses.models.decoder.model import Transformer

    model = Transformer(args)
    torch.testing.assert_close(model.rope_inv_freq, rope_frequencies(args.rotary_dim, args.rope_theta,
                                                                     args.rope_scaling)[0])
    if rope_type == "longrope":
        cos_short, _ = model.rope(torch.arange(1024))
        cos_long, _ = model.rope(torch.arange(1025))
        assert not torch.allclose(cos_short[:, 1:2], cos_long[:, 1:2])  # position 1: other frequencies


def test_the_types_differ_where_the_tests_look():
    """A mutation guard: the cases' frequencies are not all the plain ones (so a type ignored would fail)."""
    plain = rope_frequencies(64, 1e6, None)[0]
    yarn = args_from_hf_config({"model_type": "qwen3", **BASE, **CASES["yarn"][1]}).rope_scaling
    truncated = rope_frequencies(64, 1e6, yarn)[0]
    untruncated = rope_frequencies(64, 1e6, args_from_hf_config(
        {"model_type": "qwen3", **BASE, **CASES["yarn-no-truncate"][1]}).rope_scaling)[0]
    assert (truncated - plain).abs().max() > 1e-3 and (truncated - untruncated).abs().max() > 1e-6


@pytest.mark.parametrize("cfg, message", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type 'dynamic' is not supported: it rescales RoPE by the length of each inference call"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_parameters.rope_type 'mrope' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters.factor is missing"),
])
def test_refused_rope_settings_name_the_field(cfg, message):
    with pytest.raises(HFConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        args_from_hf_config({"model_type": "llama", **BASE, **cfg})
