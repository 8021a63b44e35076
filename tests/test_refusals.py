"""Bad layouts and shapes are refused before any process group work, with a message naming the setting."""

import pytest
import torch

from titan_ulysses.data.sharding import check_seq_len, shard_batch
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import check_heads, kv_replication_factor
from titan_ulysses.models.llama.args import get_flavor
from titan_ulysses.ops.attention import build_attention


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"^data_parallel_shard_degree 2 x ulysses_degree 2 = 4, but the world size is 8"):
        ParallelDims(dp_shard=2, sp=2, world_size=8)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by .*ulysses_degree.* = 4"):
        ParallelDims(sp=4, world_size=6)
    with pytest.raises(ValueError, match="ulysses_degree 0 must be >= 1"):
        ParallelDims(sp=0, world_size=2)


def test_dp_shard_fills_the_rest():
    pd = ParallelDims(dp_replicate=2, sp=2, tp=2, world_size=16)
    assert pd.degrees == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "sp": 2, "tp": 2}
    assert pd.size("dp_shard_sp") == 4 and pd.size("loss") == 8 and pd.size("dp") == 4
    assert ParallelDims(sp=2, world_size=2).fsdp_enabled  # sp alone still needs gradient reduction
    assert not ParallelDims(tp=2, world_size=2).fsdp_enabled


def test_mesh_needs_building_first():
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(world_size=1).get_mesh("sp")


def test_heads_that_cannot_be_laid_out_name_working_degrees():
    with pytest.raises(ValueError, match=r"ulysses_degree 32 is larger than the 16 attention heads per tensor-parallel "
                                         r"rank .*ulysses_degree can be at most 16; .*16 x 2, 8 x 4"):
        check_heads(16, 4, sp=32, tp=1)
    with pytest.raises(ValueError, match=r"n_kv_heads 4 is not divisible by tensor_parallel_degree 8"):
        check_heads(32, 4, sp=1, tp=8)
    with pytest.raises(ValueError, match=r"n_heads 12 is not divisible by tensor_parallel_degree 8"):
        check_heads(12, 4, sp=1, tp=8)
    check_heads(16, 4, sp=3, tp=1)  # uneven head counts are split unevenly (tests/test_uneven_heads.py)
    check_heads(24, 6, sp=4, tp=1)


def test_kv_heads_fewer_than_sp_are_replicated_not_refused():
    check_heads(32, 8, sp=16, tp=1)  # 8 kv heads, sp 16: replicate x2
    check_heads(16, 1, sp=8, tp=1)
    assert kv_replication_factor(16, 4, 8) == 2
    assert kv_replication_factor(16, 1, 8) == 8
    assert kv_replication_factor(16, 8, 4) == 1


def test_seq_len_not_divisible_without_padding():
    with pytest.raises(ValueError, match=r"seq_len 1000 is not divisible by ulysses_degree 3; use seq_len 999 or 1002"):
        check_seq_len(1000, 3)
    tokens = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len 10 is not divisible by ulysses_degree 4"):
        shard_batch(tokens, tokens, 0, 4, pad=False)
    check_seq_len(524288, 8)


def test_padding_marks_labels_ignored_and_keeps_global_positions():
    tokens = torch.arange(10).view(1, 10)
    last = shard_batch(tokens, tokens, 3, 4)  # 10 -> 12 tokens, rank 3 holds 9, 10, 11
    assert last.tokens.tolist() == [[9, 0, 0]]
    assert last.labels.tolist() == [[9, -100, -100]]
    assert last.positions.tolist() == [[9, 10, 11]]
    docs = shard_batch(tokens, tokens, 0, 4, document_ids=torch.zeros(1, 10, dtype=torch.long))
    assert docs.document_ids.tolist() == [[0] * 10 + [-1, -1]]


def test_unknown_flavor_and_backend():
    with pytest.raises(ValueError, match="model flavor '7B' is not one of"):
        get_flavor("7B")
    with pytest.raises(ValueError, match="attn_backend 'xformers' is not one of"):
        build_attention("xformers")


def test_flash_attn_missing_is_a_clear_error():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="attn_backend 'flash_attn' needs the flash-attn package"):
            build_attention("flash_attn")
    else:
        assert build_attention("flash_attn") is not None


@pytest.mark.slow
def test_under_torchrun_the_refusal_is_also_the_last_line():
    """torchrun's ChildFailedError report ends with our line (rank 0's error file), not a link to its docs."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "train.py", "--config", "train_configs/debug_model.toml", "--parallelism.ulysses_degree",
                           "3"], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    ours = [line for line in proc.stderr.splitlines() if line.startswith("config error: ")]
    assert len(ours) == 1 and ours[0].startswith("config error: parallelism: world size 2 is not divisible by"), \
        proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("=")][-1]
    assert last == f"  traceback : {ours[0]}", proc.stderr
