"""The trainer with ``--parallelism.context_parallel_degree``: through torchrun, across layouts, in fake mode."""

import pytest


def test_trainer_runs_context_parallel_through_torchrun(tmp_path):
    """A run written at ulysses_degree 2 resumes through torchrun at ``--parallelism.context_parallel_degree 2``
    and its step equals one process's (weights, optimizer and data position carried across layouts)."""
    import json
    import os
    import subprocess
    import sys

    from test_trainer import BASE, layout, losses, run

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "100"]
    ref = losses(run(1, ["--training.steps", "3"] + layout(), tmp_path, "single"))
    first = losses(run(2, ["--training.steps", "2"] + ckpt + layout(sp=2), tmp_path, "resumed"))
    folder = tmp_path / "resumed"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
         *BASE, "--training.steps", "3", *ckpt, *layout(), "--parallelism.context_parallel_degree", "2",
         "--job.dump_folder", str(folder)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'cp': 2" in proc.stdout and "starting at step 2" in proc.stdout
    with open(folder / "metrics.jsonl") as f:
        resumed = losses([json.loads(line) for line in f])
    for s in range(1, 4):
        got = first[s] if s < 3 else resumed[s]
        assert got == pytest.approx(ref[s], rel=1e-5), f"step {s}: {got} vs {ref[s]}"




def test_fake_world_runs_cp_and_reports_its_volume(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from titan_ulysses.metrics.comm import context_parallel_bytes_per_step
    from titan_ulysses.models.llama.args import get_flavor

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "fake"
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--comm.mode", "fake",
         "--comm.fake_world_size", "8", "--parallelism.ulysses_degree", "4", "--parallelism.context_parallel_degree", "2",
         "--training.seq_len", "1024", "--training.local_batch_size", "1", "--training.steps", "1",
         "--checkpoint.enable", "false", "--job.dump_folder", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'cp': 2" in proc.stdout and "'sp': 4" in proc.stdout
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    expected = context_parallel_bytes_per_step(get_flavor("debugmodel"), 1024, 1, 2, 4, 1, 4, False)
    assert metrics[-1]["cp_gib_per_step"] == pytest.approx(expected / 2**30)
