"""eval_needle on a checkpoint written by the trainer: the same numbers at sp=2 as in one process, with the
model arguments and data settings the checkpoint records (not the config's defaults)."""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "train_configs", "debug_model.toml")


def _run(args, nproc=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] \
        if nproc else [sys.executable]
    env = dict(os.environ)
    if not nproc:  # one process: a free port, not the default 29500 another job on the machine may hold
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([*launcher, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint the trainer wrote at sp=2 (in forked ranks: no torchrun, no fresh imports)."""
    from dist_utils import run_distributed
    from helpers import train_worker

    dump = tmp_path_factory.mktemp("run")
    # trained at 128 tokens with RoPE theta 50000, where the config says 512 and 10000
    run_distributed(train_worker, 2, ["--config", CONFIG, "--training.steps", "2", "--training.seq_len", "128",
                                      "--model.rope_theta", "50000", "--checkpoint.interval", "2",
                                      "--job.dump_folder", str(dump)])
    return os.path.join(dump, "checkpoint", "step-2")


@pytest.mark.slow
def test_ulysses_evaluation_equals_one_process(checkpoint, tmp_path):
    grid = ["--lengths", "112,160", "--depths", "0,1", "--samples", "3", "--training.passkey_digits", "2"]
    script = os.path.join("scripts", "eval_needle.py")
    proc = _run([script, "--config", CONFIG, "--checkpoint", checkpoint, *grid, "--output", str(tmp_path / "sp2")],
                nproc=2)
    assert "note: rope_theta 50000.0 from the checkpoint's model_args.json (the config says 10000.0)" in proc.stdout
    # the same model given on the command line: equal numbers show that the record was used
    _run([script, "--config", CONFIG, "--checkpoint", checkpoint, *grid, "--output", str(tmp_path / "one"),
          "--parallelism.ulysses_degree", "1", "--model.rope_theta", "50000"])
    sp2, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("sp2", "one"))
    assert sp2["trained_seq_len"] == 128 and sp2["rope_theta"] == 50000.0
    assert sp2["layout"]["sp"] == 2 and one["layout"]["sp"] == 1
    assert sp2["lengths"] == [112, 160] and sp2["depths"] == [0.0, 1.0] and sp2["digits"] == 2
    assert sp2["accuracy"] == one["accuracy"] and sp2["digit_accuracy"] == one["digit_accuracy"]
    for row2, row1 in zip(sp2["digit_nll"], one["digit_nll"]):
        for a, b in zip(row2, row1):
            assert abs(a - b) <= 1e-4 * b and 0.5 < b < 20  # a 2-step model is far from retrieval
    assert (tmp_path / "sp2.png").stat().st_size > 10_000  # the heatmap was drawn


@pytest.mark.slow
def test_bad_depth_and_checkpoint_are_refused_by_name(checkpoint):
    """Each refusal comes before any process group: called in this process, the script's
    SystemExit(message) is what `python scripts/eval_needle.py` prints before exiting 1."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import eval_needle

    for extra, message in ((["--checkpoint", checkpoint, "--depths", "0,1.5"], "every depth must lie within [0, 1]"),
                           (["--checkpoint", os.path.dirname(checkpoint)], "is not a complete checkpoint"),
                           (["--checkpoint", checkpoint, "--lengths", "64", "--parallelism.ulysses_degree", "1"],
                            "--lengths: 64 is too short")):
        with pytest.raises(SystemExit) as e:
            eval_needle.main(["--config", CONFIG, *extra])
        assert isinstance(e.value.code, str) and message in e.value.code, e.value.code
