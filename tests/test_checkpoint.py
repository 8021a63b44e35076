"""Checkpoint manager: failing saves lose nothing, retention, async, model-only loads, NaN stops."""

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from model_harness import build_pair, full, small_args
from titan_ulysses.checkpoint import manager as ckpt
from titan_ulysses.checkpoint.manager import CheckpointManager, complete_steps
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.models.llama.parallelize import ParallelizeOptions


class Counter:
    """A stand-in for the data loader / scheduler: any object with state_dict/load_state_dict."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _setup(folder, **kwargs):
    pd = ParallelDims(sp=2, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    _, model = build_pair(small_args(), pd, ParallelizeOptions(param_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader, sched = Counter(), Counter()
    mgr = CheckpointManager(folder=folder, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
                            enable=True, interval=1, **kwargs)
    return model, opt, loader, mgr


def _train_step(model, opt):
    tokens = torch.randint(0, 264, (1, 8))
    model(tokens, labels=tokens).backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model):
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def _failing_save_keeps_last_good(folder):
    model, opt, loader, mgr = _setup(folder)
    _train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    good = _snapshot(model)
    _train_step(model, opt)
    loader.n = 2

    def broken_save(state, checkpoint_id):
        os.makedirs(checkpoint_id, exist_ok=True)
        open(os.path.join(checkpoint_id, f"__{dist.get_rank()}_0.distcp"), "w").write("half")
        raise OSError("disk full")

    real_save, ckpt.dcp.save = ckpt.dcp.save, broken_save
    try:
        with pytest.raises(OSError, match="disk full"):
            mgr.save(2)
    finally:
        ckpt.dcp.save = real_save
    dist.barrier()
    assert complete_steps(folder) == [1] and mgr.latest_step() == 1
    assert mgr.load() == 1  # the half-written step-2.tmp is never picked
    assert loader.n == 1
    for name, value in _snapshot(model).items():
        torch.testing.assert_close(value, good[name], msg=lambda m: f"{name}: {m}")


def test_failing_save_keeps_the_last_good_checkpoint(tmp_path):
    run_distributed(_failing_save_keeps_last_good, 2, str(tmp_path))


def _retention_and_async(folder, async_mode):
    model, opt, loader, mgr = _setup(folder, async_mode=async_mode, keep_latest_k=2)
    assert mgr.load() == 0  # nothing to resume
    for step in range(1, 5):
        _train_step(model, opt)
        loader.n = step
        mgr.save(step)
    mgr.close()
    expected = _snapshot(model)
    dist.barrier()
    assert complete_steps(folder) == [3, 4]
    assert not [d for d in os.listdir(folder) if d.endswith(".tmp")]
    _train_step(model, opt)  # move away, then come back
    assert mgr.load() == 4 and loader.n == 4
    for name, value in _snapshot(model).items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_keep_latest_k_and_async_saves(tmp_path, async_mode):
    run_distributed(_retention_and_async, 2, str(tmp_path), async_mode)


def _model_only(folder):
    model, opt, loader, mgr = _setup(folder)
    _train_step(model, opt)
    loader.n = 7
    mgr.save(1)
    saved = _snapshot(model)
    fresh_model, _, fresh_loader, fresh = _setup(os.path.join(folder, "new-run"))
    fresh.load_model_only(os.path.join(folder, "step-1"))
    assert fresh_loader.n == 0  # only weights came over
    for name, value in _snapshot(fresh_model).items():
        torch.testing.assert_close(value, saved[name])
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        fresh.load_model_only(os.path.join(folder, "step-99"))


def test_initial_load_model_only(tmp_path):
    run_distributed(_model_only, 2, str(tmp_path))
