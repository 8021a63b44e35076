"""config.json's numbers are range-checked as strictly as the TOML's, in pre-flight, naming the file and the field.

The RoPE factor rule is transformers' own: whatever transformers warns about, we refuse.
"""

import json
import logging

import pytest

from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.interop.hf_config import HFConfigError, args_from_hf_config, load_hf_args
from titan_ulysses.preflight import validate

BASE = dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
            intermediate_size=128, vocab_size=320, max_position_embeddings=4096)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
QWEN_MOE = dict(model_type="qwen3_moe", head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


def _folder(tmp_path, **cfg):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return str(folder)


@pytest.mark.parametrize("cfg, field, message", [
    ({"rope_scaling": {**YARN, "factor": -4}}, "rope_scaling.factor", "must be >= 1 for rope_type 'yarn'"),
    ({"rope_scaling": {**YARN, "factor": 0.5}}, "rope_scaling.factor", "must be >= 1 for rope_type 'yarn'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor", "must be >= 1"),
    ({"rope_theta": 0}, "rope_theta", "must be positive, got 0"),
    ({"rope_theta": -10000.0}, "rope_theta", "must be positive, got -10000.0"),
    ({"rms_norm_eps": -1}, "rms_norm_eps", "must be positive, got -1"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "must be positive, got 0"),
    ({"hidden_size": 64.5}, "hidden_size", "must be a whole number, got 64.5"),
    ({"rope_theta": "10000"}, "rope_theta", "must be a number, got '10000'"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor", "must lie in (0, 1], got 1.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}}, "rope_parameters.rope_theta",
     "must be a finite number"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 1024}}, "rope_scaling.high_freq_factor",
     "must be greater than low_freq_factor"),
    ({"rope_scaling": {**YARN, "beta_fast": 1, "beta_slow": 32}}, "rope_scaling.beta_fast", "must be at least"),
    ({"model_type": "gemma3_text", "head_dim": 16, "sliding_window_pattern": 0}, "sliding_window_pattern",
     "must be positive"),
    ({"model_type": "gemma3_text", "head_dim": 16, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 0.25, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.factor", "must be >= 1"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4,
                                             "long_factor": [1.0, 0.0, 1.0, 1.0]}},
     "rope_scaling.long_factor[1]", "must be positive"),
    # Phi-3 longrope of the wrong length: broadcast error at model build before, even in --dry-run
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                             "long_factor": [1.0] * 3}},
     "rope_scaling.short_factor", "has 3 entries; longrope needs one per rotary frequency, 4"),
    # mixtures of experts (issue 38): each passed --dry-run, then broke at the first step (or even in the dry run)
    ({**QWEN_MOE, "num_experts_per_tok": 0}, "num_experts_per_tok", "must be positive, got 0"),
    ({**QWEN_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok", "9 must lie in [1, 8] (experts each token goes "
                                                                    "to, of num_experts 8)"),
    ({"model_type": "mixtral", "num_experts_per_tok": 9}, "num_experts_per_tok", "of 8 experts, the family's"),
    ({"model_type": "mixtral", "num_experts_per_tok": -1}, "num_experts_per_tok", "must be positive, got -1"),
    ({"model_type": "mixtral", "num_local_experts": 0}, "num_local_experts", "0: a mixture of experts needs at least"),
    ({"model_type": "mixtral", "num_local_experts": -8}, "num_local_experts", "must be >= 0, got -8"),
    ({**QWEN_MOE, "num_experts_per_tok": None}, "num_experts_per_tok", "is missing; model_type 'qwen3_moe' needs it"),
    ({**QWEN_MOE, "moe_intermediate_size": None}, "moe_intermediate_size", "is missing"),
    ({**QWEN_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step", "must be positive"),
    ({**QWEN_MOE, "output_router_logits": True, "router_aux_loss_coef": 1e30}, "router_aux_loss_coef",
     "must lie in [0, 1], got 1e+30"),
])
def test_an_impossible_number_is_refused_naming_file_and_field(tmp_path, cfg, field, message):
    folder = _folder(tmp_path, **{k: v for k, v in cfg.items() if v is not None})  # None: the key is absent
    with pytest.raises(HFConfigError) as e:
        load_hf_args(folder)
    line = str(e.value)
    assert line.startswith(f"{folder}/config.json: {field} ") and message in line and "\n" not in line, line
    # in pre-flight: the launch and the dry run refuse it before any process group, as a ConfigError
    with pytest.raises(ConfigError, match=f"^model.hf_assets_path: {folder}/config.json: {field} ".replace(
            "[", r"\[").replace("(", r"\(")):
        validate(load_config(["--model.hf_assets_path", folder, "--model.tokenizer", "hf"]), 1)


def test_valid_numbers_still_pass():
    args = args_from_hf_config({**BASE, "rope_scaling": YARN, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                                "num_key_value_heads": None, "sliding_window": None})
    assert (args.n_kv_heads, args.rope_scaling.factor, args.norm_eps) == (8, 4.0, 1e-5)
    assert args_from_hf_config({**BASE, "rope_scaling": {**YARN, "factor": 1}}).rope_scaling.factor == 1.0


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "llama3", "longrope"])
@pytest.mark.parametrize("factor", [-4, 0, 0.5, 0.999, 1, 1.0, 4])
def test_the_factor_rule_is_transformers(rope_type, factor):
    """Refused exactly where transformers' validation says the factor must be >= 1."""
    transformers = pytest.importorskip("transformers")
    params = {"rope_type": rope_type, "factor": factor, "original_max_position_embeddings": 1024,
              "rope_theta": 10000.0}
    if rope_type == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 4, long_factor=[2.0] * 4)
    handler = _Warnings()
    logger = logging.getLogger("transformers.modeling_rope_utils")
    logger.addHandler(handler)
    try:
        transformers.LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, rope_parameters=params)
    finally:
        logger.removeHandler(handler)
    theirs = any("factor field must be a float or int >= 1" in m for m in handler.messages)
    try:
        args_from_hf_config({**BASE, "model_type": "phi3" if rope_type == "longrope" else "llama",
                             "rope_parameters": params})
        ours = False
    except HFConfigError as e:
        assert "factor must be >= 1" in str(e)
        ours = True
    assert ours == theirs == (factor < 1)


def test_the_toml_factor_follows_the_same_rule():
    """model.rope_scaling_factor below 1 would write a config.json that transformers (and we) refuse."""
    with pytest.raises(ConfigError, match=r"^model.rope_scaling_factor must be 0 \(off\) or >= 1 .*got 0.5$"):
        validate(load_config(["--model.rope_scaling_factor", "0.5"]), 1)
    validate(load_config(["--model.rope_scaling_factor", "1"]), 1)


def test_the_toml_load_balancing_weight_has_config_jsons_bound():
    """--model.router_aux_loss_coef 1e30 passed validation and stopped the run at step 1 (issue 38)."""
    with pytest.raises(ConfigError, match=r"^model.router_aux_loss_coef must lie in \[-1, 1\], got 1e\+30"):
        validate(load_config(["--model.router_aux_loss_coef", "1e30"]), 1)
