"""comm.mode = "fake": one process plays rank 0 of a larger job; the all-to-all volume model."""

import os

import pytest

from helpers import run_fake_world
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.metrics.comm import ulysses_bytes_per_step
from titan_ulysses.models.flavors import get_flavor
from titan_ulysses.preflight import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a2a_volume_by_hand():
    args = get_flavor("debugmodel")  # 6 layers, 16 heads, 4 kv heads (-> 8 at sp=8), head_dim 16
    # per layer and pass: 512 local tokens x 16 x 4 bytes x 7/8, times (16 q + 16 kv + 16 out) heads
    per_pass = 512 * 16 * 4 * 7 / 8 * 48
    assert ulysses_bytes_per_step(args, 4096, 1, 8, 1, 4, False) == pytest.approx(6 * 2 * per_pass)
    assert ulysses_bytes_per_step(args, 4096, 1, 8, 1, 4, True) == pytest.approx(6 * 3 * per_pass)
    assert ulysses_bytes_per_step(args, 4096, 1, 1, 1, 4, False) == 0.0


@pytest.mark.slow
def test_fake_world_runs_a_production_layout_in_one_process(tmp_path):
    stdout, metrics = run_fake_world(tmp_path, 8, "--parallelism.ulysses_degree", "8", "--training.seq_len", "4096",
                                     "--training.steps", "2", "--metrics.log_freq", "1")
    assert "FAKE process group: rank 0 of 8" in stdout and "'sp': 8" in stdout
    assert [m["step"] for m in metrics] == [1, 2]
    expected = ulysses_bytes_per_step(get_flavor("debugmodel"), 4096, 1, 8, 1, 4, False)
    assert metrics[-1]["a2a_gib_per_step"] == pytest.approx(expected / 2**30)
    assert metrics[-1]["max_memory_gib"] > 0


@pytest.mark.parametrize("argv,world,message", [
    (["--comm.mode", "fake", "--checkpoint.enable", "true"], 1, "checkpoint.enable must be false with comm.mode 'fake'"),
    (["--comm.mode", "fake"], 2, "launch 1 process, not 2"),
])
def test_fake_mode_refusals(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(argv), world)


def test_fake_mode_checks_the_simulated_layout():
    c = load_config(["--comm.mode", "fake", "--comm.fake_world_size", "32", "--parallelism.ulysses_degree", "8"])
    assert validate(c, 1).degrees == {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "sp": 8, "tp": 1}
