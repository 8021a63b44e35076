"""The sources a run starts from, for tests/test_run_spec*.py: a tiny Llama folder and checkpoints the trainer
wrote (a flavor extended x4, the folder extended x4, a LoRA run), with ``train.main`` in this process."""

import os
import sys

import pytest

from dist_utils import run_distributed
from hf_fixtures import make_hf_model, make_tokenizer
from titan_ulysses.config.manager import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
COMMON = ["--training.seq_len", "128", "--training.local_batch_size", "1", "--training.mixed_precision_param",
          "float32", "--training.steps", "1", "--metrics.enable_tensorboard", "false"]


def _train(argv, out=""):
    """Build the trainer (a resume's refusal or what it names goes to ``out``), then train unless asked to stop."""
    from titan_ulysses.trainer import Trainer

    try:
        trainer = Trainer(load_config(argv))
    except ConfigError as e:
        if out:
            open(out, "w").write(f"refused: {e}")
        return
    if out:
        open(out, "w").write(trainer.resumed)
        return
    trainer.train()


def _run(argv, dump, out=""):
    run_distributed(_train, 1, [*COMMON, "--checkpoint.enable", "true", "--checkpoint.interval", "1",
                                "--job.dump_folder", str(dump), *argv], out)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A tiny Llama folder, and checkpoints of three runs: a flavor extended x4, the folder extended x4, LoRA."""
    root = tmp_path_factory.mktemp("spec")
    hf = str(root / "hf")
    make_hf_model(hf, "llama", {})
    make_tokenizer(hf)
    runs = {"extended_flavor": ["--model.rope_scaling_factor", "4"],
            "extended_hf": ["--model.hf_assets_path", hf, "--model.rope_scaling_factor", "4"],
            "lora": ["--model.hf_assets_path", hf, "--lora.rank", "4"]}
    out = {"hf": hf, "root": root, "empty": str(root / "empty.toml"), "argv": runs}
    (root / "empty.toml").write_text("")
    for name, argv in runs.items():
        _run(argv, root / name)
        out[name] = str(root / name / "checkpoint" / "step-1")
    return out



