"""Checkpoint manager: resharding loads, async == sync, failing saves lose nothing, retention, model-only loads.

Every worker runs on gloo ranks with the tiny model in fp32; values are compared exactly
(a checkpoint round trip must not change a bit).
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from dist_utils import run_distributed
from helpers import Counter, assert_equal, checkpoint_setup, scramble, snapshot, tiny_train_step
from titan_ulysses.checkpoint import manager as ckpt
from titan_ulysses.checkpoint.manager import CheckpointManager, complete_steps


def _opt_snapshot(model, opt):
    """FQN-keyed full optimizer state (collective), comparable across layouts."""
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {fqn: {k: v.clone() for k, v in s.items()} for fqn, s in sd["state"].items()}


# -- (a) a checkpoint saved at sp=2 loads at other layouts -----------------------------------

def _save_at_sp2(folder):
    model, opt, loader, sched, mgr = checkpoint_setup(folder)
    tiny_train_step(model, opt)
    loader.n, sched.n = 3, 5
    torch.manual_seed(100 + dist.get_rank())  # ranks differ: rank 0's generator is the one saved
    rng = torch.get_rng_state()
    mgr.save(1)
    params, opt_state = snapshot(model), _opt_snapshot(model, opt)
    assert len(opt_state) == len(params) and all(float(s["step"]) == 1.0 for s in opt_state.values())
    if dist.get_rank() == 0:
        torch.save({"params": params, "opt": opt_state, "rng": rng}, os.path.join(folder, "expected.pt"))


def _load_at(folder, layout):
    expected = torch.load(os.path.join(folder, "expected.pt"))
    model, opt, loader, sched, mgr = checkpoint_setup(folder, layout)
    scramble(model)
    assert mgr.latest_step() == 1
    torch.manual_seed(999)
    assert mgr.load() == 1
    assert loader.n == 3 and sched.n == 5
    assert torch.equal(torch.get_rng_state(), expected["rng"])  # rank 0's, on every rank
    assert_equal(snapshot(model), expected["params"], "param")
    assert_equal(_opt_snapshot(model, opt), expected["opt"], "optimizer")
    tiny_train_step(model, opt)  # the loaded optimizer state is usable at the new layout
    assert all(float(s["step"]) == 2.0 for s in _opt_snapshot(model, opt).values())


@pytest.mark.parametrize("layout,world", [({"dp_shard": 2}, 2), ({"sp": 2, "dp_shard": 2}, 4)],
                         ids=["dp_shard2", "sp2-dp_shard2"])
def test_load_reshards_to_another_layout(tmp_path, layout, world):
    run_distributed(_save_at_sp2, 2, str(tmp_path))
    assert complete_steps(str(tmp_path)) == [1]
    run_distributed(_load_at, world, str(tmp_path), layout)


# -- (b) async saves write what sync saves write, as of the save() call -----------------------

def _async_equals_sync(folder):
    model, opt, loader, _, sync = checkpoint_setup(os.path.join(folder, "disabled"))
    managers = {mode: CheckpointManager(folder=os.path.join(folder, mode), model=model, optimizer=opt,
                                        lr_scheduler=Counter(), dataloader=loader, enable=True, interval=1,
                                        async_mode=mode)
                for mode in ("async", "async_with_pinned_mem")}
    tiny_train_step(model, opt)
    loader.n = 1
    sync.save(1)
    params, opt_state = snapshot(model), _opt_snapshot(model, opt)
    for mgr in managers.values():
        mgr.save(1)
    tiny_train_step(model, opt)  # training goes on while the saves are in flight
    loader.n = 2
    for mgr in managers.values():
        mgr.close()
    for mode, mgr in {"disabled": sync, **managers}.items():
        assert complete_steps(mgr.folder) == [1] and os.listdir(mgr.folder) == ["step-1"], mode
        scramble(model)
        assert mgr.load() == 1 and loader.n == 1, mode
        assert_equal(snapshot(model), params, f"{mode} param")
        assert_equal(_opt_snapshot(model, opt), opt_state, f"{mode} optimizer")


def test_async_saves_equal_the_sync_save(tmp_path):
    run_distributed(_async_equals_sync, 2, str(tmp_path))


def _pinned_stager_survives_being_closed(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode="async_with_pinned_mem")
    tiny_train_step(model, opt)
    mgr.save(1)
    mgr.wait()
    # torch 2.11 closes the inner stager after every stage, emptying its dispatch table: the
    # next save met the classes inside every DTensor's spec with KeyError: <class 'type'>
    mgr._stager._state_dict_stager.close()
    tiny_train_step(model, opt)
    params = snapshot(model)
    mgr.save(2)
    mgr.close()
    assert complete_steps(folder) == [1, 2]
    scramble(model)
    assert mgr.load() == 2
    assert_equal(snapshot(model), params, "param after the second pinned save")


def test_pinned_stager_survives_a_close_between_saves(tmp_path):
    run_distributed(_pinned_stager_survives_being_closed, 2, str(tmp_path))


# -- (c) a failing save keeps the last good checkpoint ----------------------------------------

def _expect_last_good(folder, mgr, model, loader, good):
    dist.barrier()
    assert complete_steps(folder) == [1] and mgr.latest_step() == 1
    scramble(model)
    assert mgr.load() == 1  # a half-written step-N.tmp is never picked
    assert loader.n == 1
    assert_equal(snapshot(model), good, "param")


def _failing_saves(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder)
    tiny_train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    good = snapshot(model)
    tiny_train_step(model, opt)
    loader.n = 2

    # 1. the save function dies after writing a shard
    def broken_save(state, checkpoint_id, **kwargs):
        os.makedirs(checkpoint_id, exist_ok=True)
        with open(os.path.join(checkpoint_id, f"__{dist.get_rank()}_0.distcp"), "w") as f:
            f.write("half")
        raise OSError("disk full")

    real_save, ckpt.dcp.save = ckpt.dcp.save, broken_save
    try:
        with pytest.raises(OSError, match="disk full"):
            mgr.save(2)
    finally:
        ckpt.dcp.save = real_save
    _expect_last_good(folder, mgr, model, loader, good)

    # 2. DCP writes every rank's shards, then writing the metadata fails (sync, then async)
    def broken_finish(self, metadata, results):
        raise RuntimeError("metadata write failed")

    async_mgr = CheckpointManager(folder=folder, model=model, optimizer=opt, lr_scheduler=Counter(),
                                  dataloader=loader, enable=True, interval=1, async_mode="async")
    for step, manager in ((3, mgr), (4, async_mgr)):
        tiny_train_step(model, opt)
        loader.n = step
        FileSystemWriter.finish = broken_finish
        try:
            # DCP re-raises rank 0's failure on every rank (a BaseException, not an Exception)
            with pytest.raises((CheckpointException, OSError), match="metadata write failed"):  # OSError: explained
                manager.save(step)
                manager.wait()
        finally:
            del FileSystemWriter.finish  # back to the inherited method
        tmp = os.path.join(folder, f"step-{step}.tmp")
        assert any(f.endswith(".distcp") for f in os.listdir(tmp))
        assert not os.path.exists(os.path.join(tmp, ".metadata"))
        _expect_last_good(folder, mgr, model, loader, good)

    # the next good save clears the leftovers
    loader.n = 5
    mgr.save(5)
    assert sorted(os.listdir(folder)) == ["step-1", "step-5"]
    assert mgr.latest_step() == 5


def test_failing_save_keeps_the_last_good_checkpoint(tmp_path):
    run_distributed(_failing_saves, 2, str(tmp_path))


# -- (d) retention, (e) nothing to resume -----------------------------------------------------

def _retention(folder, async_mode):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode=async_mode, keep_latest_k=2)
    assert mgr.latest_step() is None
    assert mgr.load() == 0 and loader.n == 0  # nothing to resume, nothing changed
    snapshots = {}
    for step in range(1, 5):
        tiny_train_step(model, opt)
        loader.n = step
        mgr.save(step)
        snapshots[step] = snapshot(model)
    mgr.close()
    dist.barrier()
    assert complete_steps(folder) == [3, 4] and sorted(os.listdir(folder)) == ["step-3", "step-4"]
    tiny_train_step(model, opt)  # move away, then come back
    assert mgr.load() == 4 and loader.n == 4
    assert_equal(snapshot(model), snapshots[4], "param")
    assert mgr.load(3) == 3 and loader.n == 3
    assert_equal(snapshot(model), snapshots[3], "param")
    with pytest.raises(FileNotFoundError, match=r"step-2' does not exist; the complete checkpoints in .* are step-3, "
                                                r"step-4$"):
        mgr.load(2)  # deleted by retention


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_keep_latest_k_and_load_without_checkpoint(tmp_path, async_mode):
    run_distributed(_retention, 2, str(tmp_path), async_mode)


# -- model-only loads (initial_load_path) ------------------------------------------------------

def _model_only(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder)
    tiny_train_step(model, opt)
    loader.n = 7
    mgr.save(1)
    saved = snapshot(model)
    fresh_model, fresh_opt, fresh_loader, _, fresh = checkpoint_setup(os.path.join(folder, "new-run"))
    fresh.load_model_only(os.path.join(folder, "step-1"))
    assert fresh_loader.n == 0 and not fresh_opt.state  # only weights came over
    assert_equal(snapshot(fresh_model), saved, "param")
    assert fresh.latest_step() is None
    with pytest.raises(FileNotFoundError, match=r"step-99' does not exist; the complete checkpoints in .* are step-1$"):
        fresh.load_model_only(os.path.join(folder, "step-99"))
    # the full-state variant (initial_load_model_only false) brings the step and the loader too
    assert fresh.load_from(os.path.join(folder, "step-1")) == 1 and fresh_loader.n == 7
    assert len(fresh_opt.state) == len(saved)


def test_initial_load_model_only(tmp_path):
    run_distributed(_model_only, 2, str(tmp_path))
