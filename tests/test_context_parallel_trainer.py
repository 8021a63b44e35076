"""The trainer with ``--parallelism.context_parallel_degree``: through torchrun, across layouts, in fake mode.

One chain of runs on the debug model (seq_len 128, 4 sequences a step), every step's loss
held to one process's at rtol 1e-5: steps 1-2 at ulysses_degree 2 (2 ranks, checkpointed),
step 3 resumed through torchrun at context_parallel_degree 2 (2 processes), steps 4-5
resumed through torchrun at context_parallel_degree 2 x ulysses_degree 2 (4 processes) with
selective activation checkpointing. Each resume carries weights, AdamW state and the data
position across a change of layout, and each layout's loss must equal the single process's
(a wrong shard, a token seen twice or a missing K/V gradient moves it by far more).
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import BASE, layout, losses, run, run_fake_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "100"]


def _torchrun(nproc: int, steps: int, extra: list[str], folder) -> tuple[str, dict]:
    """``train.py`` through torchrun, resuming from ``folder``'s checkpoint; (stdout, losses by step)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "train.py",
         *BASE, "--training.steps", str(steps), *CKPT, *layout(), *extra, "--job.dump_folder", str(folder)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(folder / "metrics.jsonl") as f:
        return proc.stdout, losses([json.loads(line) for line in f])


@pytest.mark.slow
def test_trainer_resumes_across_sp_cp_and_cp_x_sp_through_torchrun(tmp_path):
    ref = losses(run(1, ["--training.steps", "5"] + layout(), tmp_path, "single"))
    assert ref[5] < ref[1], "the loss should fall"
    folder = tmp_path / "chain"
    got = losses(run(2, ["--training.steps", "2"] + CKPT + layout(sp=2), tmp_path, "chain"))

    out, resumed = _torchrun(2, 3, ["--parallelism.context_parallel_degree", "2"], folder)
    assert "'cp': 2, 'sp': 1" in out and "starting at step 2" in out, out[-2000:]
    got[3] = resumed[3]

    # 4 processes: heads exchanged within sp, K/V gathered over cp, the all-gather kept by selective AC
    out, resumed = _torchrun(4, 5, ["--parallelism.context_parallel_degree", "2", "--parallelism.ulysses_degree", "2",
                                    "--activation_checkpoint.mode", "selective"], folder)
    assert "'cp': 2, 'sp': 2" in out and "starting at step 3" in out, out[-2000:]
    got[4], got[5] = resumed[4], resumed[5]

    for s in range(1, 6):
        assert got[s] == pytest.approx(ref[s], rel=1e-5), f"step {s}: {got[s]} vs {ref[s]}"


@pytest.mark.slow
def test_fake_world_runs_cp_and_reports_its_volume(tmp_path):
    from titan_ulysses.metrics.comm import context_parallel_bytes_per_step
    from titan_ulysses.models.flavors import get_flavor

    stdout, metrics = run_fake_world(tmp_path, 8, "--parallelism.ulysses_degree", "4",
                                     "--parallelism.context_parallel_degree", "2", "--training.seq_len", "1024",
                                     "--training.steps", "1")
    assert "'cp': 2" in stdout and "'sp': 4" in stdout
    expected = context_parallel_bytes_per_step(get_flavor("debugmodel"), 1024, 1, 2, 4, 1, 4, False)
    assert metrics[-1]["cp_gib_per_step"] == pytest.approx(expected / 2**30)
