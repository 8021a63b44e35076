"""Context extension by the model's own method, and an export that transformers reads back silently.

``extend_context`` picks the method (the model's existing scaling, else its family's: llama3
for Llama, yarn for Qwen / Mistral), and original_max_position_embeddings defaults to the
model's own max_position_embeddings. The exported config.json then says what was trained:
transformers loads it without a warning and gives our logits at the extended length.
"""

import json
import logging
import os
import warnings

import pytest
import torch

from dist_utils import assert_close
from hf_fixtures import make_hf_model
from helpers import add_manifest
from titan_ulysses.interop.hf_weights import load_hf_weights
from titan_ulysses.interop.hf_export import export_hf, write_model_record
from titan_ulysses.models.decoder.args import RopeScaling
from titan_ulysses.models.extension import extend_context
from titan_ulysses.models.flavors import get_flavor
from titan_ulysses.interop.hf_config import args_from_hf_config, load_hf_args
from titan_ulysses.models.registry import build_model

transformers = pytest.importorskip("transformers")
BASE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=128, vocab_size=320, max_position_embeddings=4096)


def test_the_method_is_the_models_own():
    qwen = extend_context(args_from_hf_config({"model_type": "qwen3", **BASE}), 4.0, max_position_embeddings=4096)
    assert (qwen.rope_scaling.rope_type, qwen.rope_scaling.factor,
            qwen.rope_scaling.original_max_position_embeddings) == ("yarn", 4.0, 4096)
    mistral = extend_context(args_from_hf_config({"model_type": "mistral", **BASE}), 2.0, max_position_embeddings=4096)
    assert mistral.rope_scaling.rope_type == "yarn"
    llama = extend_context(args_from_hf_config({"model_type": "llama", **BASE}), 2.0, max_position_embeddings=4096)
    assert (llama.rope_scaling.rope_type, llama.rope_scaling.original_max_position_embeddings) == ("llama3", 4096)
    # Llama 3.1 stretched further: its own scaling, its own original length (8192), a new factor
    flavor = extend_context(get_flavor("8B"), 16.0)
    assert flavor.rope_scaling == RopeScaling(factor=16.0)
    assert extend_context(get_flavor("debugmodel"), 2.0).rope_scaling == RopeScaling(factor=2.0)
    linear = extend_context(args_from_hf_config({"model_type": "qwen3", **BASE}), 2.0, "linear", 1024)
    assert (linear.rope_scaling.rope_type, linear.rope_scaling.original_max_position_embeddings) == ("linear", 1024)
    phi3 = args_from_hf_config({"model_type": "phi3", **BASE})
    with pytest.raises(ValueError, match="^model.rope_scaling_factor: model_type 'phi3' has no context-extension "
                                         "method of its own; set model.rope_scaling_type"):
        extend_context(phi3, 2.0)
    assert extend_context(phi3, 2.0, "yarn").rope_scaling.rope_type == "yarn"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("model_type, method", [("qwen3", "yarn"), ("llama", "llama3"), ("mistral", "linear")])
def test_export_at_the_extended_length_loads_silently_with_our_logits(tmp_path, model_type, method):
    import torch.distributed.checkpoint as dcp

    src, trained = 16, 48  # trained 3x past the source's max_position_embeddings
    folder = str(tmp_path / "src")
    make_hf_model(folder, model_type, dict(max_position_embeddings=src, rope_theta=10000.0,
                                           **({"head_dim": 16} if model_type == "qwen3" else {}),
                                           **({"sliding_window": None} if model_type == "mistral" else {})))
    args = extend_context(load_hf_args(folder), 3.0, "linear" if method == "linear" else "", 0, src)
    assert args.rope_scaling.rope_type == method
    model = build_model(args)
    load_hf_weights(model, folder)
    step = str(tmp_path / "step-1")
    dcp.save({"model": model.state_dict()}, checkpoint_id=step, no_dist=True)
    write_model_record(step, args, folder, seq_len=trained)
    add_manifest(step)
    export_hf(step, None, str(tmp_path / "out"), torch.float32)
    config = json.loads(open(tmp_path / "out" / "config.json").read())
    assert config["max_position_embeddings"] >= trained and config["rope_scaling"]["rope_type"] == method
    assert config["rope_scaling"]["factor"] == 3.0
    if method != "linear":
        assert config["rope_scaling"]["original_max_position_embeddings"] == src
    records = _Records()
    logging.getLogger("transformers").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert not records.messages and not caught, (records.messages, [str(w.message) for w in caught])
    hf.config._attn_implementation = "eager"
    tokens = torch.randint(0, args.vocab_size, (2, trained), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
        plain = build_model(load_hf_args(folder))
        load_hf_weights(plain, folder)
        unscaled = plain(tokens)
    assert_close(theirs, ours, f"{model_type} {method} logits at {trained} tokens")
    assert (unscaled - ours).abs().max() > 100 * 1e-5 * ours.abs().max()  # the scaling shows at this length


def test_a_flavors_extension_starts_from_the_length_it_is_trained_at():
    """Issue 32 item 5: the debug model extended 512 -> 1024 (the guide's recipe) scales RoPE from its own 512, not
    from llama3's default 8192 (which would barely change it); the Llama shapes keep their own 8192."""
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.models.resolve import model_args

    debug = model_args(load_config(["--config", "train_configs/debug_model.toml", "--model.rope_scaling_factor", "2"]))
    assert debug.rope_scaling == RopeScaling(factor=2.0, original_max_position_embeddings=512)
    assert model_args(load_config(["--model.flavor", "8B", "--model.rope_scaling_factor", "16"])).rope_scaling == \
        RopeScaling(factor=16.0)
    assert model_args(load_config(["--model.flavor", "debugmodel", "--model.rope_scaling_factor", "2",
                                   "--model.rope_original_max_position_embeddings", "256"])
                      ).rope_scaling.original_max_position_embeddings == 256  # the setting wins
