"""The trainer end to end on gloo: layouts agree step by step, resume is exact, signals save."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from titan_ulysses.config.manager import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A schedule that does not depend on the total step count, so a run cut at step 3 and
# resumed to step 6 follows the same learning rates as an uninterrupted 6-step run.
BASE = [
    "--model.flavor", "debugmodel", "--training.dataset", "passkey",
    "--training.seq_len", "128", "--training.global_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--training.max_norm", "1.0",
    "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
    "--metrics.log_freq", "1",
]


def layout(sp=1, dp_shard=-1, local_batch=4):
    return ["--parallelism.ulysses_degree", str(sp), "--parallelism.data_parallel_shard_degree", str(dp_shard),
            "--training.local_batch_size", str(local_batch)]


def read_metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(argv, hooks=None):
    from titan_ulysses.trainer import Trainer

    trainer = Trainer(load_config(argv))
    if hooks == "sigterm_rank0_at_2" and dist.get_rank() == 0:
        step_fn = trainer.train_step

        def step_then_signal(data_iter):
            out = step_fn(data_iter)
            if trainer.step == 1:  # the step about to finish is step 2
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        trainer.train_step = step_then_signal
    if hooks == "nan_at_3":
        step_fn = trainer.train_step

        def poisoned_step(data_iter):
            if trainer.step == 2:  # step 3 sees NaN weights on every rank
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.fill_(float("nan"))
            return step_fn(data_iter)

        trainer.train_step = poisoned_step
    trainer.train()


def run(world, argv, tmp, name, hooks=None):
    folder = str(tmp / name)
    run_distributed(_train, world, BASE + argv + ["--job.dump_folder", folder], hooks)
    return read_metrics(folder)


def saved_rng(step_dir):
    """Rank 0's generator state saved in a checkpoint (read without a process group)."""
    import torch.distributed.checkpoint as dcp

    state = {"train_state": {"rng": torch.get_rng_state().clone()}}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state["train_state"]["rng"]


def losses(metrics):
    return {m["step"]: m["loss"] for m in metrics}


def assert_losses_equal(actual, expected, steps):
    for s in steps:
        assert actual[s] == pytest.approx(expected[s], rel=1e-5), f"step {s}: {actual[s]} vs {expected[s]}"


def test_loss_sequence_equal_across_layouts(tmp_path):
    ref = losses(run(1, ["--training.steps", "4"] + layout(), tmp_path, "single"))
    sp2 = losses(run(2, ["--training.steps", "4"] + layout(sp=2), tmp_path, "sp2"))
    dp_sp = losses(run(4, ["--training.steps", "4"] + layout(sp=2, dp_shard=2, local_batch=2), tmp_path, "dp2sp2"))
    assert ref[4] < ref[1], "the loss should fall"
    assert_losses_equal(sp2, ref, range(1, 5))
    assert_losses_equal(dp_sp, ref, range(1, 5))
    # the memory switches change nothing numerically (and reach the model from the config)
    lean = ["--model.loss_chunk_size", "50", "--model.mlp_tile_size", "48",
            "--activation_checkpoint.mode", "full_offload", "--training.enable_cpu_offload", "true"]
    sp2_lean = losses(run(2, ["--training.steps", "4"] + lean + layout(sp=2), tmp_path, "sp2_lean"))
    assert_losses_equal(sp2_lean, ref, range(1, 5))


def test_resume_equals_uninterrupted_and_reshards(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    tb = ["--metrics.enable_tensorboard", "true"]
    full = losses(run(2, ["--training.steps", "6"] + ckpt + tb + layout(sp=2), tmp_path, "full"))
    events = [f for _, _, files in os.walk(tmp_path / "full" / "tb") for f in files]
    assert any(f.startswith("events.out.tfevents") for f in events)
    # same layout: stop at 3, rerun the same command to 6
    run(2, ["--training.steps", "3"] + ckpt + layout(sp=2), tmp_path, "resumed")
    resumed = losses(run(2, ["--training.steps", "6"] + ckpt + layout(sp=2), tmp_path, "resumed"))
    assert_losses_equal(resumed, full, range(4, 7))
    # the generator state saved after a resume is that of the uninterrupted run, not one draw ahead
    assert torch.equal(saved_rng(tmp_path / "resumed" / "checkpoint" / "step-6"),
                       saved_rng(tmp_path / "full" / "checkpoint" / "step-6"))
    # another layout: written at sp=2 on 2 ranks, resumed at dp_shard=2 x sp=2 on 4 ranks
    run(2, ["--training.steps", "3"] + ckpt + layout(sp=2), tmp_path, "resharded")
    resharded = losses(
        run(4, ["--training.steps", "6"] + ckpt + layout(sp=2, dp_shard=2, local_batch=2), tmp_path, "resharded")
    )
    assert_losses_equal(resharded, full, range(4, 7))


def test_context_extension_starts_from_another_runs_weights(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "100"]
    run(2, ["--training.steps", "6"] + ckpt + layout(sp=2), tmp_path, "short")
    longer = ["--training.steps", "1", "--training.seq_len", "256", "--model.rope_scaling_factor", "2"] + layout(sp=2)
    fresh = run(2, longer, tmp_path, "fresh")
    extended = run(2, longer + ckpt + ["--checkpoint.initial_load_path", str(tmp_path / "short" / "checkpoint" / "step-6")],
                   tmp_path, "extended")
    # a new run (step 1, its own schedule) whose weights already know the task
    assert [m["step"] for m in extended] == [1]
    assert extended[0]["loss"] < 0.7 * fresh[0]["loss"]


def test_sigterm_on_one_rank_saves_and_stops_all(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "100"]
    metrics = run(2, ["--training.steps", "50"] + ckpt + layout(sp=2), tmp_path, "preempted", "sigterm_rank0_at_2")
    assert [m["step"] for m in metrics] == [1, 2]
    assert sorted(os.listdir(tmp_path / "preempted" / "checkpoint")) == ["step-2"]


def test_nan_loss_stops_without_touching_the_last_checkpoint(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    with pytest.raises(Exception, match="loss is nan at step 3"):
        run(2, ["--training.steps", "10"] + ckpt + layout(sp=2), tmp_path, "nan", "nan_at_3")
    assert sorted(os.listdir(tmp_path / "nan" / "checkpoint")) == ["step-2"]
    assert [m["step"] for m in read_metrics(tmp_path / "nan")] == [1, 2]


def test_config_error_exits_nonzero_with_one_line():
    proc = subprocess.run(
        [sys.executable, "train.py", "--training.seq_lenn", "64"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "training.seq_len" in proc.stderr and "did you mean" in proc.stderr
