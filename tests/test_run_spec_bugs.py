"""The three silent errors of issue 34 part 1, each a test that fails before the run spec (titan_ulysses/run_spec.py)
and passes with it; only what existed before is imported, so the file runs on either side.

1. A run from an extended checkpoint dropped its RoPE scaling (and recorded none).
2. A Hugging Face folder without --model.tokenizer hf silently used the byte tokenizer.
3. scripts/eval_long.py ignored the checkpoint's recorded RoPE, and refused --model.tokenizer hf without a folder.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from hf_fixtures import make_hf_model, make_tokenizer
from spec_fixtures import COMMON, ROOT, SCRIPTS, _run, fx  # noqa: F401 (fixtures)
from titan_ulysses.interop.hf_export import read_model_record
from titan_ulysses.data.tokenizer import ByteTokenizer, build_tokenizer
from titan_ulysses.interop.hf_config import describe


@pytest.mark.slow
def test_bug1_the_dry_run_from_an_extended_checkpoint_shows_its_rope_scaling(fx, tmp_path, train_main):
    """The dry run from a checkpoint extended from a folder or a flavor names the recorded scaling (it showed the
    config's model: plain RoPE)."""
    for name in ("extended_flavor", "extended_hf"):
        recorded = read_model_record(fx[name])[0]
        assert recorded.rope_scaling is not None and recorded.rope_scaling.factor == 4.0
        code, out, err = train_main([*COMMON, "--job.dump_folder", str(tmp_path / f"dry_{name}"),
                                     "--checkpoint.initial_load_path", fx[name], "--dry-run"])
        assert code == 0, err
        assert describe(recorded) in out, out


@pytest.mark.slow
def test_bug1_a_run_from_an_extended_checkpoint_keeps_its_rope_scaling(fx, tmp_path, capfd):
    """The model-only flavor run from an extended checkpoint (SFT after context extension) starts with the
    recorded scaling, names it and the tokenizer on its start-up line, and records the scaling again."""
    dump = tmp_path / "sft"
    capfd.readouterr()
    _run(["--checkpoint.initial_load_path", fx["extended_flavor"]], dump)
    startup = next(line for line in capfd.readouterr().out.splitlines() if line.startswith("titan-ulysses:"))
    recorded = read_model_record(fx["extended_flavor"])[0]
    # the start-up line names the recorded model and the tokenizer (bug 2: it did not name the tokenizer)
    assert describe(recorded) in startup and f"tokenizer byte ({ByteTokenizer.vocab_size} ids" in startup, startup
    again = read_model_record(str(dump / "checkpoint" / "step-1"))[0]
    assert again.rope_scaling == read_model_record(fx["extended_flavor"])[0].rope_scaling


def test_bug2_a_hugging_face_folder_uses_its_tokenizer_or_refuses_another(fx, tmp_path, train_main):
    base = [*COMMON, "--job.dump_folder", str(tmp_path / "run"), "--dry-run", "--world-size", "2"]
    code, out, err = train_main([*base, "--model.hf_assets_path", fx["hf"]])
    assert code == 0, err
    assert f"tokenizer hf {fx['hf']} ({build_tokenizer('hf', fx['hf']).vocab_size} ids" in out
    big = str(tmp_path / "big")  # a pretrained vocabulary more than twice the byte tokenizer's
    make_hf_model(big, "llama", {"vocab_size": 2 * 264 + 8})
    make_tokenizer(big)
    code, out, err = train_main([*base, "--config", os.path.join(ROOT, "train_configs", "debug_model.toml"),
                                 "--model.hf_assets_path", big])
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"config error: model.tokenizer 'byte' has 264 ids but model.hf_assets_path has a pretrained "
                      f"vocabulary of {2 * 264 + 8}: not its tokenizer; leave model.tokenizer unset (or set 'hf') to "
                      f"use the folder's tokenizer.json")


@pytest.mark.slow
def test_bug3_eval_long_uses_the_recorded_rope_and_accepts_the_hf_tokenizer(fx, tmp_path):
    held_out = tmp_path / "held_out.txt"
    held_out.write_text(" ".join(["The pass key is 12345. Remember it."] * 80))
    env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29700 + os.getpid() % 200)}

    def run(tag, *extra):
        out = str(tmp_path / tag)
        proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "eval_long.py"), "--config", fx["empty"],
                               "--checkpoint", fx["extended_hf"], "--data", str(held_out), "--seq-len", "96",
                               "--max-docs", "1", "--keys", "1", "--needle-samples", "1", "--output", out,
                               "--model.tokenizer", "hf", "--training.mixed_precision_param", "float32", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(open(out + ".json").read())

    recorded = read_model_record(fx["extended_hf"])[0]
    plain = run("recorded")
    assert plain["rope_scaling"] == dataclasses.asdict(recorded.rope_scaling)
    other = run("x1", "--model.rope_scaling_factor", "1")  # a given setting overrides the record
    assert other["rope_scaling"]["factor"] == 1.0
    assert other["loss_by_position"]["mean_loss"] != plain["loss_by_position"]["mean_loss"]


