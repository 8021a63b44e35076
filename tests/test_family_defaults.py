"""What config.json leaves unsaid is decided as transformers decides it: Gemma's local/global layers without
``layer_types``, and longrope's choice of factors exactly at the original context length."""

import pytest
import torch

from titan_ulysses.interop.hf_config import args_from_hf_config
from titan_ulysses.models.registry import build_model

transformers = pytest.importorskip("transformers")

BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128, vocab_size=320,
            head_dim=16)


@pytest.mark.parametrize("pattern", [None, 6, 4, 3])
def test_gemma3_layer_types_from_sliding_window_pattern(pattern):
    """No ``layer_types`` key (older Gemma 3 files): every ``sliding_window_pattern``-th layer is global."""
    extra = {} if pattern is None else {"sliding_window_pattern": pattern}
    cfg = {**BASE, "num_hidden_layers": 12, **extra}
    ours = args_from_hf_config({"model_type": "gemma3_text", **cfg}).layer_types
    theirs = transformers.Gemma3TextConfig(**cfg).layer_types
    assert ours == list(theirs) and "full_attention" in ours and "sliding_attention" in ours


@pytest.mark.parametrize("pattern", [None, 6])
def test_gemma2_layer_types_alternate(pattern):
    """Gemma 2 alternates sliding and global layers; transformers ignores a ``sliding_window_pattern`` key."""
    extra = {} if pattern is None else {"sliding_window_pattern": pattern}
    cfg = {**BASE, "num_hidden_layers": 12, **extra}
    ours = args_from_hf_config({"model_type": "gemma2", **cfg}).layer_types
    assert ours == list(transformers.Gemma2Config(**cfg).layer_types)


ORIGINAL = 16
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7], "long_factor": [1.0, 1.9, 3.7, 6.3]}


def _phi3():
    cfg = {**BASE, "head_dim": 8, "num_hidden_layers": 1, "rope_scaling": LONGROPE,
           "original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 4 * ORIGINAL}
    return cfg, transformers.Phi3Config(**cfg)


@pytest.mark.parametrize("seq_len", [ORIGINAL - 1, ORIGINAL, ORIGINAL + 1])
def test_longrope_switches_to_long_factors_only_beyond_the_original_length(seq_len):
    """transformers: long factors when ``seq_len > original_max_position_embeddings``; at it, the short ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, config = _phi3()
    model = build_model(args_from_hf_config({"model_type": "phi3", **cfg}))
    theirs, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    positions = torch.arange(seq_len)
    angles = positions[:, None].float() * theirs.float()
    expected = (angles.cos() * factor, angles.sin() * factor)
    for rope_seq_len in (seq_len, 0):  # the trainer's full length, and the choice on the largest position
        model.rope_seq_len = rope_seq_len
        cos, sin = model.rope(positions)
        torch.testing.assert_close(cos[0, :, 0], expected[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[0, :, 0], expected[1], rtol=1e-6, atol=1e-6)
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL + 1)
    assert not torch.equal(short, long)  # the two sets differ, so the boundary is tested
