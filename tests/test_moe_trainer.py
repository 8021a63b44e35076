"""A mixture of experts through the trainer's own loop (train.py's Trainer, gloo ranks): started from a
Hugging Face folder at ep=2 x sp=2, it logs the language-model loss, the load-balancing loss and the
experts' load; its checkpoint resumes at another expert degree (ep=1) and continues as the run that
never stopped."""

import shutil

import pytest

from dist_utils import run_distributed
from helpers import read_metrics, train_worker
from test_moe_families import hf_moe

pytest.importorskip("transformers")
STEPS = 4


def _argv(folder, dump, ep):
    return ["--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf", "true", "--model.tokenizer", "byte",
            "--training.dataset", "passkey", "--training.seq_len", "128", "--training.local_batch_size", "2",
            "--training.global_batch_size", "2", "--training.steps", str(STEPS),
            "--training.mixed_precision_param", "float32", "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0", "--metrics.log_freq", "1",
            "--parallelism.ulysses_degree", "2", "--parallelism.expert_parallel_degree", str(ep),
            "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(dump)]


@pytest.mark.slow
def test_moe_trains_logs_its_router_and_resumes_at_another_ep_degree(tmp_path):
    folder = str(tmp_path / "hf")
    hf_moe("qwen3_moe").save_pretrained(folder)
    run_distributed(train_worker, 2, _argv(folder, tmp_path / "ep2", ep=2))
    whole = {m["step"]: m for m in read_metrics(tmp_path / "ep2")}
    assert sorted(whole) == list(range(1, STEPS + 1))
    for m in whole.values():
        assert m["aux_loss"] > 0 and m["expert_load_max_over_mean"] >= 1.0
    assert whole[STEPS]["loss"] < whole[1]["loss"]
    assert len({m["aux_loss"] for m in whole.values()}) > 1  # the router moves: its statistics are this step's

    # the same run cut at step 2 and resumed with the experts on every rank (ep=1)
    resumed = tmp_path / "ep1"
    shutil.copytree(tmp_path / "ep2" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_distributed(train_worker, 2, _argv(folder, resumed, ep=1))
    after = {m["step"]: m for m in read_metrics(resumed)}
    assert sorted(after) == [3, 4]
    for step in (3, 4):  # only the order of float sums differs between the two layouts
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(after[step][key] - whole[step][key]) <= 1e-4 * abs(whole[step][key]), (step, key)


def test_router_aux_loss_coef_overrides_config_json(tmp_path):
    """Released MoE configs say output_router_logits false (no load-balancing loss, as transformers trains
    them); model.router_aux_loss_coef turns it on, and is refused where it cannot mean anything."""
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.models.resolve import model_args

    hf = hf_moe("qwen3_moe")
    hf.config.output_router_logits = False
    hf.save_pretrained(tmp_path / "hf")
    base = ["--model.hf_assets_path", str(tmp_path / "hf")]
    assert model_args(load_config(base)).moe.aux_loss_coef == 0.0  # config.json's: off
    assert model_args(load_config(base + ["--model.router_aux_loss_coef", "0.001"])).moe.aux_loss_coef == 0.001
    with pytest.raises(ConfigError, match=r"^model.router_aux_loss_coef -0.5: -1 \(config.json's\), 0 \(off\) or a "):
        model_args(load_config(base + ["--model.router_aux_loss_coef", "-0.5"]))
    with pytest.raises(ConfigError, match=r"^model.router_aux_loss_coef 0.01: model.flavor 'debugmodel' has no "
                                          r"experts; leave it at -1$"):
        model_args(load_config(["--model.router_aux_loss_coef", "0.01"]))


def test_selective_ac_with_expert_parallelism_is_refused_in_one_line(tmp_path):
    """It failed at step 1's backward (the experts' FSDP unit inside a selectively checkpointed block
    replays a different number of ops); full and full_offload work, and selective without ep."""
    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.preflight import validate

    hf_moe("qwen3_moe").save_pretrained(tmp_path / "hf")
    base = ["--model.hf_assets_path", str(tmp_path / "hf"), "--parallelism.ulysses_degree", "2",
            "--activation_checkpoint.mode"]
    with pytest.raises(ConfigError, match=r"^activation_checkpoint.mode selective with "
                                          r"parallelism.expert_parallel_degree 2: not supported .*; use mode full"):
        validate(load_config(base + ["selective", "--parallelism.expert_parallel_degree", "2"]), 2)
    validate(load_config(base + ["selective"]), 2)
    validate(load_config(base + ["full", "--parallelism.expert_parallel_degree", "2"]), 2)
