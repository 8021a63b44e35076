"""What a run is, resolved once (issue 34 part 1, issue 33 item 5): ``titan_ulysses/run_spec.py``.

Every tool resolves the same spec from each source (a flavor, a Hugging Face folder, extended
checkpoints of both, a LoRA checkpoint); the three silent errors of the issue each have a test;
a resume refuses a changed model setting unless ``checkpoint.override_recorded`` lists it, and
names it when it does.
"""

import argparse
import dataclasses
import sys

import pytest

from dist_utils import run_distributed
from spec_fixtures import COMMON, SCRIPTS, _train, fx  # noqa: F401 (fixtures)
from titan_ulysses.interop.hf_export import read_model_record
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.models.extension import extend_context
from titan_ulysses.models.flavors import TRAINED_SEQ_LEN, get_flavor
from titan_ulysses.interop.hf_config import load_hf_args, read_hf_config
from titan_ulysses.run_spec import resolve_run

SOURCES = ["flavor", "hf", "extended_flavor", "extended_hf", "lora"]


def _source(fx, name) -> tuple[list[str], str]:
    """(config settings, checkpoint) of a source: a checkpoint is the start of a run, the one a tool reads."""
    if name == "flavor":
        return [], ""
    if name == "hf":
        return ["--model.hf_assets_path", fx["hf"]], ""
    return ([], fx[name]) if name != "lora" else (["--lora.rank", "4"], fx[name])


def _expected_args(fx, name):
    """The model each source is, computed from its inputs (not from the spec)."""
    if name == "flavor":
        return get_flavor("debugmodel")
    if name in ("hf", "lora"):
        return load_hf_args(fx["hf"])
    if name == "extended_flavor":
        return extend_context(get_flavor("debugmodel"), 4.0, max_position_embeddings=TRAINED_SEQ_LEN["debugmodel"])
    return extend_context(load_hf_args(fx["hf"]), 4.0, max_position_embeddings=read_hf_config(fx["hf"])[
        "max_position_embeddings"])


def _key(spec):
    return (spec.args, spec.hf_folder, spec.tokenizer, spec.tokenizer_path, spec.tokenizer_vocab, spec.overrides)


def _tools(fx, tmp_path, settings, checkpoint, train_main):
    """Each tool's spec (or model arguments, where the tool has no tokenizer) for one source."""
    sys.path.insert(0, SCRIPTS)
    import estimate_memory
    import eval_long
    import eval_needle
    import export_hf
    import plan

    from titan_ulysses.preflight import check_launch

    base = [*COMMON, "--job.dump_folder", str(tmp_path / "run"), *settings]
    start = ["--checkpoint.initial_load_path", checkpoint] if checkpoint else []
    found = {"train": check_launch(load_config([*base, *start]))[1],
             "estimate_memory": estimate_memory.prepare(["--config", fx["empty"], *base, *start], 1)[1]}
    code, out, err = train_main([*base, *start, "--dry-run"])
    assert code == 0, err
    found["dry_run"] = out
    if checkpoint:
        found["eval_needle"] = eval_needle.prepare(argparse.Namespace(config=fx["empty"], checkpoint=checkpoint),
                                                   base, 1)[1]
        found["export"] = export_hf.spec_args(argparse.Namespace(checkpoint=checkpoint, flavor="", rope_theta=0.0,
                                                                 rope_scaling_factor=0.0), settings)
    if checkpoint or settings:
        found["eval_long"] = eval_long.prepare(argparse.Namespace(config=fx["empty"], seq_len=0,
                                                                  checkpoint=checkpoint or fx["hf"]), base, 1)[1]
    if not checkpoint:
        ns = argparse.Namespace(flavor="debugmodel", hf_assets_path=fx["hf"] if settings else "", seq_len=128, gpus=1,
                                gpu_memory_gib=80.0)
        found["plan"] = plan.plan_config(ns)[2]
    return base, start, found


@pytest.mark.slow
@pytest.mark.parametrize("name", SOURCES)
def test_every_tool_resolves_the_same_spec_from_every_source(fx, name, tmp_path, train_main):
    settings, checkpoint = _source(fx, name)
    base, start, found = _tools(fx, tmp_path, settings, checkpoint, train_main)
    reference = resolve_run(load_config([*base, *start]))
    expected = _expected_args(fx, name)
    assert reference.args == expected
    assert reference.tokenizer == ("byte" if name in ("flavor", "extended_flavor") else "hf")
    for tool in ("train", "eval_needle", "eval_long"):
        if tool in found:
            assert _key(found[tool]) == _key(reference), tool
    assert found["estimate_memory"].args == reference.args and found["estimate_memory"].tokenizer == reference.tokenizer
    for tool in ("export", "plan"):
        if tool in found:
            assert found[tool] == reference.args, tool
    assert reference.source in found["dry_run"] and reference.tokenizer_line() in found["dry_run"]


def test_a_rope_setting_given_for_a_new_run_overrides_the_record_and_is_named(fx):
    """Context extension of a checkpoint: a RoPE setting given is the user's override, named; one equal to the
    record changes nothing; none given keeps the record (the default 0 means "the model's")."""
    recorded = read_model_record(fx["extended_flavor"])[0]
    start = ["--checkpoint.initial_load_path", fx["extended_flavor"]]
    spec = resolve_run(load_config([*COMMON, *start, "--model.rope_scaling_factor", "8"]))
    assert spec.args.rope_scaling == dataclasses.replace(recorded.rope_scaling, factor=8.0)
    assert spec.overrides == (f"model.rope_scaling_factor llama3 x4 -> llama3 x8 (the config's; "
                              f"{fx['extended_flavor']} recorded llama3 x4)",)
    for extra in ([], ["--model.rope_scaling_factor", "4"]):
        same = resolve_run(load_config([*COMMON, *start, *extra]))
        assert same.args == recorded and same.overrides == ()


@pytest.mark.slow
def test_a_resume_refuses_a_changed_model_setting_and_names_an_override(fx, tmp_path):
    dump, argv = fx["root"] / "lora", fx["argv"]["lora"]
    out = str(tmp_path / "said")

    def resume(*extra):
        run_distributed(_train, 1, [*COMMON, "--checkpoint.enable", "true", "--checkpoint.interval", "1",
                                    "--job.dump_folder", str(dump), *argv, "--training.steps", "2", *extra], out)
        return open(out).read()

    said = resume("--lora.alpha", "64")
    assert said.startswith("refused: the resumed checkpoint was trained with other model settings (lora.alpha 16.0 "
                           "-> 64.0)") and "--checkpoint.override_recorded lora.alpha, or train" in said, said
    said = resume("--lora.alpha", "64", "--checkpoint.override_recorded", "lora.alpha",
                  "--activation_checkpoint.mode", "full")
    assert "overridden (checkpoint.override_recorded): lora.alpha 16.0 -> 64.0" in said, said
    assert "the config changes training.steps 1 -> 2" in said and "activation_checkpoint.mode none -> full" in said


def test_override_recorded_names_only_recorded_settings():
    with pytest.raises(ConfigError, match="^checkpoint.override_recorded names 'optimizer.lr', which no record holds"):
        resolve_run(load_config(["--checkpoint.override_recorded", "optimizer.lr"]), tokenizer=False)


def test_resume_changes_sort_what_the_model_computes_from_how_it_runs():
    """--model.rope_scaling_factor 4 on resume (issue 33 item 5) is refused like lora.alpha; layout, AC and compile
    changes are applied and named; checkpoints older than a saved setting do not compare it."""
    from titan_ulysses.config.resume import overrides, resume_changes, resume_settings

    saved = resume_settings(load_config([]))
    argv = ["--model.rope_scaling_factor", "4", "--parallelism.ulysses_degree", "2", "--compile.enable", "true",
            "--activation_checkpoint.mode", "selective"]
    with pytest.raises(ConfigError, match=r"\(model.rope_scaling_factor 0.0 -> 4.0\); nothing was loaded: set them "
                                          r"back, resume on purpose with --checkpoint.override_recorded "
                                          r"model.rope_scaling_factor, or train these settings from the start in "
                                          r"another job.dump_folder \(or checkpoint.folder\)$"):
        resume_changes(saved, resume_settings(load_config(argv)))
    config = load_config([*argv, "--checkpoint.override_recorded", "model.rope_scaling_factor"])
    said = resume_changes(saved, resume_settings(config), overrides(config))
    assert said == ("overridden (checkpoint.override_recorded): model.rope_scaling_factor 0.0 -> 4.0; the layout "
                    "changes parallelism.ulysses_degree 1 -> 2, activation_checkpoint.mode none -> selective, "
                    "compile.enable False -> True")
    older = {k: v for k, v in saved.items() if not k.startswith(("model.", "parallelism.", "compile."))}
    assert resume_changes(older, resume_settings(config)).startswith("the layout changes activation_checkpoint.mode")


def test_the_advice_for_another_lora_rank_works(fx, tmp_path):
    """A new run from a LoRA checkpoint at another rank (the advice of the resume refusal) was a traceback; now it is
    refused before any process group, and the merged model it names starts that run (issue 38 item 3)."""
    sys.path.insert(0, SCRIPTS)
    import export_hf

    from titan_ulysses.preflight import check_launch

    base = [*COMMON, "--job.dump_folder", str(tmp_path / "run"), "--lora.rank", "8"]
    with pytest.raises(ConfigError, match=f"lora.rank 8 cannot hold rank-4 adapters: .* titan-export --checkpoint "
                                          f"{fx['lora']} --output DIR, then --model.hf_assets_path DIR without"):
        check_launch(load_config([*base, "--checkpoint.initial_load_path", fx["lora"]]))
    merged = str(tmp_path / "merged")
    assert export_hf.main(["--checkpoint", fx["lora"], "--output", merged]) == 0
    spec = check_launch(load_config([*base, "--model.hf_assets_path", merged]))[1]
    assert (spec.weights.kind, spec.args, spec.tokenizer) == ("hf", load_hf_args(fx["hf"]), "hf")


@pytest.fixture
def resolutions(monkeypatch):
    """Every call of ``apply_model_settings`` (the model's resolution), wherever it is made from."""
    import titan_ulysses.models.resolve as resolve
    import titan_ulysses.run_spec as run_spec

    calls, apply = [], resolve.apply_model_settings

    def counted(*args, **kwargs):
        calls.append(args[0])
        return apply(*args, **kwargs)

    monkeypatch.setattr(resolve, "apply_model_settings", counted)
    monkeypatch.setattr(run_spec, "apply_model_settings", counted)
    return calls


def test_a_dry_run_resolves_the_model_once(resolutions, tmp_path):
    """Issue 46 item 2: the launch path's checks (validate, check_files with its tokenizer, check_resume, the
    plan) read one resolved value; check_files resolved the whole run again for the tokenizer."""
    from titan_ulysses.preflight import plan

    text = plan(load_config(["--job.dump_folder", str(tmp_path), "--training.dataset", "passkey"]), 1)
    assert "flavor debugmodel" in text
    assert len(resolutions) == 1
