"""A new run from a start checkpoint's record changes nothing silently (issue 38 items 1, 3 and 5).

Each start checkpoint here is a record written in this process (``model_args.json``, ``hf_assets/``,
``lora.json``, the data settings as DCP saves them), no training: a RoPE type given alone, another
tokenizer, another lora.alpha or targets or rank, a load-balancing weight of 0 over a recorded 0.02,
and a pretrained vocabulary with the byte tokenizer are each named as an override or refused in one line.
"""

import json
import os

import pytest

from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.interop.hf_config import load_hf_args
from titan_ulysses.interop.hf_export import write_model_record
from titan_ulysses.run_spec import resolve_run

LLAMA = dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=128, vocab_size=320, max_position_embeddings=1024)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
MOE = dict(LLAMA, model_type="qwen3_moe", head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           output_router_logits=True, router_aux_loss_coef=0.02)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _start(tmp_path, cfg: dict, lora: dict | None = None, tokenizer: str = "") -> str:
    """A start checkpoint of a run from a Hugging Face folder with config.json ``cfg``: its record (and
    ``lora.json``, and the data settings naming ``tokenizer``, when given)."""
    folder, step = tmp_path / "hf", tmp_path / "run" / "step-1"
    folder.mkdir()
    step.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    write_model_record(str(step), load_hf_args(str(folder)), str(folder))
    if lora is not None:
        (step / "lora.json").write_text(json.dumps({"r": 4, "lora_alpha": 16.0, "lora_dropout": 0.0,
                                                    "target_modules": TARGETS, "base_model_name_or_path": "", **lora}))
    if tokenizer:  # the dataloader's data settings, where a checkpoint records its tokenizer
        import warnings

        import torch.distributed.checkpoint as dcp

        settings = json.dumps({"dataset": "passkey", "tokenizer": tokenizer, "tokenizer_content": tokenizer})
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"dataloader": {"dataset_state": {"data_settings": settings}}}, checkpoint_id=str(step),
                     no_dist=True)
    else:
        (step / ".metadata").write_bytes(b"")
    return str(step)


def _spec(start: str, *argv: str, tokenizer: bool = False):
    return resolve_run(load_config(["--checkpoint.initial_load_path", start, *argv]), tokenizer=tokenizer)


def test_a_rope_type_given_alone_rescales_the_record_at_its_factor_and_is_named(tmp_path):
    """--model.rope_scaling_type linear over a yarn x4 record was ignored, with no line."""
    start = _start(tmp_path, {**LLAMA, "rope_scaling": YARN})
    spec = _spec(start, "--model.rope_scaling_type", "linear")
    assert (spec.args.rope_scaling.rope_type, spec.args.rope_scaling.factor) == ("linear", 4.0)
    assert spec.overrides == (f"model.rope_scaling_type yarn x4 -> linear x4 (the config's; {start} recorded "
                              f"yarn x4)",)
    assert _spec(start, "--model.rope_scaling_type", "yarn").overrides == ()  # the recorded method: no change
    with pytest.raises(ConfigError, match="^model.rope_scaling_type 'linear' without model.rope_scaling_factor: "):
        resolve_run(load_config(["--model.rope_scaling_type", "linear"]), tokenizer=False)  # nothing to re-scale


def test_a_zero_load_balancing_weight_over_a_recorded_one_is_taken_and_named(tmp_path):
    start = _start(tmp_path, MOE)
    assert _spec(start).args.moe.aux_loss_coef == 0.02
    spec = _spec(start, "--model.router_aux_loss_coef", "0")
    assert spec.args.moe.aux_loss_coef == 0.0
    assert spec.overrides == (f"model.router_aux_loss_coef 0.02 -> 0.0 (the config's; {start} recorded 0.02)",)


def test_the_byte_tokenizer_is_refused_for_a_record_of_a_pretrained_vocabulary(tmp_path):
    """An HF-started checkpoint's vocabulary is pretrained even where no safetensors are in sight."""
    start = _start(tmp_path, {**LLAMA, "vocab_size": 2 * 264 + 8})
    with pytest.raises(ConfigError, match=rf"^model.tokenizer 'byte' has 264 ids but the record of {start} has a "
                                          rf"pretrained vocabulary of {2 * 264 + 8}: not its tokenizer"):
        _spec(start, "--model.tokenizer", "byte", tokenizer=True)


def test_another_tokenizer_than_the_recorded_one_is_named(tmp_path):
    start = _start(tmp_path, LLAMA, tokenizer="hf")
    spec = _spec(start, "--model.tokenizer", "byte", tokenizer=True)
    assert spec.overrides == (f"model.tokenizer byte (the config's; {start} was trained with hf)",)


@pytest.mark.parametrize("argv, refusal", [
    ([], "this run's lora.rank 0 would drop them"),
    (["--lora.rank", "8"], "this run's lora.rank 8 cannot hold rank-4 adapters"),
    (["--lora.rank", "4", "--lora.target_modules", "q_proj"],
     "this run's lora.target_modules q_proj would drop 6 of its 7 trained adapters"),
])
def test_a_lora_start_is_refused_where_its_adapters_would_be_dropped_or_not_fit(tmp_path, argv, refusal):
    start = _start(tmp_path, LLAMA, lora={})
    with pytest.raises(ConfigError) as e:
        _spec(start, *argv)
    line = str(e.value)
    assert line.startswith(f"checkpoint.initial_load_path {start} holds LoRA adapters (lora.rank 4, "
                           f"lora.target_modules {','.join(TARGETS)}); {refusal}: set those [lora] settings") and \
        line.endswith(f"titan-export --checkpoint {start} --output DIR, then --model.hf_assets_path DIR without "
                      f"checkpoint.initial_load_path") and "\n" not in line, line


def test_another_lora_alpha_over_a_lora_start_is_named(tmp_path):
    start = _start(tmp_path, LLAMA, lora={})
    assert _spec(start, "--lora.rank", "4").overrides == ()
    spec = _spec(start, "--lora.rank", "4", "--lora.alpha", "64")
    assert spec.overrides == (f"lora.alpha 16.0 -> 64.0 (the config's; {start} recorded 16.0)",)


@pytest.mark.parametrize("name", ["lora.rank", "lora.target_modules"])
def test_override_recorded_refuses_what_no_override_can_change(name):
    with pytest.raises(ConfigError, match=rf"^checkpoint.override_recorded names {name}, which no override can "
                                          rf"change \(a checkpoint's LoRA adapters"):
        resolve_run(load_config(["--checkpoint.override_recorded", name]), tokenizer=False)


def test_a_resume_refusal_never_advises_an_override_that_is_refused():
    from titan_ulysses.config.resume import resume_changes, resume_settings

    saved = resume_settings(load_config(["--lora.rank", "4"]))
    with pytest.raises(ConfigError, match=r"\(lora.rank 4 -> 8\); nothing was loaded: set them back; lora.rank cannot change on resume "
                                          r"\(start a new run from its merged model: titan-export"):
        resume_changes(saved, resume_settings(load_config(["--lora.rank", "8"])))


def test_a_start_record_is_resolved_once_and_says_where_each_argument_came_from(tmp_path, monkeypatch):
    """Issue 46 item 2: the recorded model with the config's settings, once; the config's own model was resolved
    a second time only to compare its RoPE (a value compared now: ``ResolvedModel.named``)."""
    import titan_ulysses.run_spec as run_spec

    calls, apply = [], run_spec.apply_model_settings
    monkeypatch.setattr(run_spec, "apply_model_settings", lambda *a, **k: calls.append(a[0]) or apply(*a, **k))
    start = _start(tmp_path, {**LLAMA, "rope_theta": 50000.0})
    spec = _spec(start, "--model.rope_scaling_factor", "2")
    assert len(calls) == 1 and calls[0].rope_theta == 50000.0
    model = spec.model
    assert model.args is spec.args and model.record == start
    assert model.origin("dim") == f"the record of {start}" and model.origin("rope_theta") == f"the record of {start}"
    assert model.origin("rope_scaling") == "the config's model settings" and spec.args.rope_scaling.factor == 2.0
