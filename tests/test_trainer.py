"""The trainer end to end on gloo: layouts agree step by step, resume is exact, signals save."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import layout, losses, read_metrics, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def saved_rng(step_dir):
    """Rank 0's generator state saved in a checkpoint (read without a process group)."""
    import torch.distributed.checkpoint as dcp

    state = {"train_state": {"rng": torch.get_rng_state().clone()}}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state["train_state"]["rng"]


def assert_losses_equal(actual, expected, steps):
    for s in steps:
        assert actual[s] == pytest.approx(expected[s], rel=1e-5), f"step {s}: {actual[s]} vs {expected[s]}"


def test_loss_sequence_equal_across_layouts(tmp_path):
    ref = losses(run(1, ["--training.steps", "4"] + layout(), tmp_path, "single"))
    sp2 = losses(run(2, ["--training.steps", "4"] + layout(sp=2), tmp_path, "sp2"))
    dp_sp = losses(run(4, ["--training.steps", "4"] + layout(sp=2, dp_shard=2, local_batch=2), tmp_path, "dp2sp2"))
    # tp alone, through the trainer's fused AdamW and step (it failed on a mixed Tensor / DTensor list, issue 43)
    tp2 = losses(run(2, ["--training.steps", "4", "--parallelism.tensor_parallel_degree", "2"] + layout(), tmp_path,
                     "tp2"))
    assert ref[4] < ref[1], "the loss should fall"
    assert_losses_equal(sp2, ref, range(1, 5))
    assert_losses_equal(tp2, ref, range(1, 5))
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
    # step 2 neither logs nor saves: its flag (with the skip decision, one all-reduce) is read one step late,
    # so every rank saves after step 3 and stops
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "100", "--metrics.log_freq", "10"]
    metrics = run(2, ["--training.steps", "50"] + ckpt + layout(sp=2), tmp_path, "preempted", "sigterm_rank0_at_2")
    assert [m["step"] for m in metrics] == [1]  # step 3 is not a logging step
    assert sorted(n for n in os.listdir(tmp_path / "preempted" / "checkpoint") if n != ".run.lock") == ["step-3"]


def test_nan_loss_stops_without_touching_the_last_checkpoint(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    with pytest.raises(Exception, match="loss is nan at step 3"):
        run(2, ["--training.steps", "10"] + ckpt + layout(sp=2), tmp_path, "nan", "nan_at_3")
    assert sorted(n for n in os.listdir(tmp_path / "nan" / "checkpoint") if n != ".run.lock") == ["step-2"]
    assert [m["step"] for m in read_metrics(tmp_path / "nan")] == [1, 2]


@pytest.mark.slow
def test_config_error_exits_nonzero_with_one_line():
    proc = subprocess.run(
        [sys.executable, "train.py", "--training.seq_lenn", "64"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "training.seq_len" in proc.stderr and "did you mean" in proc.stderr
