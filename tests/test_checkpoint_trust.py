"""Checkpoints a long run can trust (issue 15), at the manager level on 2 gloo ranks.

* each kind of damage to the newest checkpoint (a deleted shard, a truncated ``.metadata``,
  a truncated or changed shard, no ``.metadata``) is found, set aside with a warning naming
  the file, and resume falls back to the previous one; the next save of that step works;
* a fault between writing and renaming leaves the previous checkpoint the newest good one;
* weights holding NaN, or an optimizer state holding inf, are never saved, and pruning keeps
  the last good checkpoint;
* a save failing with PyTorch's zip writer's "unexpected pos" (a full disk, no ENOSPC) is
  explained with the space needed and free, and the last good checkpoint stays loadable;
* a good checkpoint of another model (its shapes, or its saved settings) is refused before
  anything is loaded, and never set aside as damaged (issue 38).
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from helpers import assert_equal, checkpoint_setup, scramble, snapshot, tiny_train_step
from titan_ulysses.checkpoint import manager as ckpt
from titan_ulysses.checkpoint.manager import NonFiniteStateError, complete_steps
from titan_ulysses.checkpoint.manifest import read_manifest


def _shard(path):
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0])


def _truncate(path, keep=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def _flip(path):
    """Change bytes in the middle of a tensor file without changing its size."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGES = {  # name -> (damage(step folder) -> the file the warning must name)
    "deleted_shard": lambda d: (lambda shard: (os.remove(shard), os.path.basename(shard))[1])(_shard(d)),
    "truncated_metadata": lambda d: (_truncate(os.path.join(d, ".metadata")), ".metadata")[1],
    "truncated_shard": lambda d: (_truncate(_shard(d)), os.path.basename(_shard(d)))[1],
    "flipped_shard": lambda d: (_flip(_shard(d)), os.path.basename(_shard(d)))[1],
    "missing_metadata": lambda d: (os.remove(os.path.join(d, ".metadata")), "no .metadata")[1],
    # a deleted manifest: the step cannot be verified, so a flipped shard would load silently; refused
    "deleted_manifest_flipped_shard": lambda d: (os.remove(os.path.join(d, "manifest.json")), _flip(_shard(d)),
                                                 "has no manifest.json, so it cannot be verified")[2],
}


def _damaged_newest_falls_back(folder, capfd):
    model, opt, loader, _, mgr = checkpoint_setup(folder)
    tiny_train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    good = snapshot(model)
    assert set(read_manifest(os.path.join(folder, "step-1"))) >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    for kind, damage in DAMAGES.items():
        tiny_train_step(model, opt)
        loader.n = 2
        mgr.save(2, force=True)
        dist.barrier()
        newest = os.path.join(folder, "step-2")
        named = None
        if dist.get_rank() == 0:
            named = damage(newest)
        dist.barrier()
        scramble(model)
        mgr._last_saved = None
        assert mgr.load() == 1, kind  # fell back
        assert loader.n == 1, kind
        assert_equal(snapshot(model), good, f"{kind} param")
        dist.barrier()
        if dist.get_rank() == 0:
            err = capfd.readouterr().err
            assert named in err and "step-2" in err, f"{kind}: {err}"
            names = sorted(os.listdir(folder))
            assert "step-2" not in names and any(n.startswith("step-2.bad") for n in names), (kind, names)
        dist.barrier()
        # the damaged step never blocks its own save: save it again, complete and verified
        tiny_train_step(model, opt)
        loader.n = 2
        mgr.save(2, force=True)
        assert complete_steps(folder) == [1, 2] and mgr.verify(newest) is None, kind
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(newest)
        mgr._last_saved = None
        dist.barrier()


def _worker_damage(folder):
    class Capture:  # capfd cannot cross the process boundary: read our own stderr file instead
        def __init__(self):
            self.path = os.path.join(folder, f"stderr-{dist.get_rank()}")
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC)
            os.dup2(self.fd, 2)
            self.pos = 0

        def readouterr(self):
            with open(self.path) as f:
                f.seek(self.pos)
                out = f.read()
                self.pos = f.tell()
            return type("R", (), {"err": out})

    ckpt_folder = os.path.join(folder, "ckpt")
    _damaged_newest_falls_back(ckpt_folder, Capture())


def test_each_damaged_newest_checkpoint_falls_back(tmp_path):
    run_distributed(_worker_damage, 2, str(tmp_path))


# -- the commit is atomic; NaN never saved; pruning keeps the last good one -------------------

def _worker_atomic_and_nonfinite(folder):
    model, opt, loader, sched, mgr = checkpoint_setup(folder, keep_latest_k=1, settings={"model.flavor": "a"})
    tiny_train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    good = snapshot(model)

    # a fault between writing (data, metadata, manifest) and the rename
    def no_rename(tmp, final):
        raise OSError("injected fault before the rename")

    real, ckpt._publish = ckpt._publish, no_rename
    try:
        tiny_train_step(model, opt)
        loader.n = 2
        with pytest.raises(OSError, match="injected fault before the rename"):
            mgr.save(2)
    finally:
        ckpt._publish = real
    assert complete_steps(folder) == [1]
    assert os.path.isfile(os.path.join(folder, "step-2.tmp", "manifest.json"))
    scramble(model)
    assert mgr.load() == 1 and loader.n == 1  # and the start-up clean-up removed step-2.tmp
    assert_equal(snapshot(model), good, "param")
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1"]

    # NaN weights (a NaN learning rate shows only after the update): refused, step-1 kept
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    loader.n = 3
    with pytest.raises(NonFiniteStateError, match=r"step 3: .*NaN/inf .*nothing was saved and the newest checkpoint, .*step-1, is kept"):
        mgr.save(3)
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1"]
    assert mgr.load() == 1
    assert_equal(snapshot(model), good, "param")

    # finite weights, an inf in one rank's optimizer state (exp_avg_sq): refused too
    if dist.get_rank() == 1:
        state = next(s for s in opt.state.values() if "exp_avg_sq" in s)
        state["exp_avg_sq"].to_local().view(-1)[0] = float("inf")
    loader.n = 4
    with pytest.raises(NonFiniteStateError, match=r"step 4: 1 tensor\(s\) .*\(rank 1: optimizer exp_avg_sq of .*\); "
                                                   r"nothing was saved and the newest checkpoint, .*step-1, is kept"):
        mgr.save(4)
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1"]
    assert mgr.load() == 1

    # a save that fails without ENOSPC (PyTorch's zip writer on a full disk): explained, step-1 untouched
    from torch.distributed.checkpoint.filesystem import FileSystem

    real_stream = FileSystem.create_stream

    @contextlib.contextmanager
    def short_write(self, path, mode):
        with real_stream(self, path, mode) as f:
            if "step-5.tmp" in str(path) and "w" in mode:
                f.write(b"half a shard")
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            yield f

    FileSystem.create_stream = short_write
    try:
        loader.n = 5
        with pytest.raises(OSError, match=r"saving .*step-5.tmp failed: a checkpoint of this run needs about "
                                          r"\d+\.\d\d GiB and \d+\.\d\d GiB are free on that filesystem; the "
                                          r"newest good checkpoint, .*step-1, is kept\. .*\(RuntimeError: \[enforce "
                                          r"fail at inline_container.cc:672\] \. unexpected pos 704 vs 598\)$"):
            mgr.save(5)
    finally:
        FileSystem.create_stream = real_stream
    scramble(model)
    assert mgr.load() == 1 and mgr.verify(os.path.join(folder, "step-1")) is None
    assert_equal(snapshot(model), good, "param")
    _other_model_is_refused(folder, model, loader, sched, mgr, good)  # here: one model build and rank start less


def test_atomic_commit_and_nonfinite_state_never_saved(tmp_path):
    run_distributed(_worker_atomic_and_nonfinite, 2, str(tmp_path))


# -- a good checkpoint of other settings is refused, never called damaged ----------------------

def _other_model_is_refused(folder, model, loader, sched, mgr, good):
    """Issue 38: a good checkpoint of another model (shapes, or saved settings refused) is refused before any load
    and never set aside as damaged (a relaunch with another model.flavor renamed every checkpoint .bad)."""
    from model_harness import build_pair, small_args
    from titan_ulysses.checkpoint.fit import SettingsMismatchError
    from titan_ulysses.config.manager import ConfigError
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions

    pd = ParallelDims(sp=2, world_size=2)
    pd.build_mesh("cpu")
    _, other = build_pair(small_args(n_kv_heads=4), pd, ParallelizeOptions(param_dtype=torch.float32))
    other_mgr = ckpt.CheckpointManager(folder=folder, model=other, optimizer=torch.optim.AdamW(other.parameters()),
                                       lr_scheduler=sched, dataloader=loader, enable=True, interval=1,
                                       settings={"model.flavor": "b"})
    with pytest.raises(SettingsMismatchError, match=r"step-1 is good but does not fit this run's model: .*wk.weight is "
                                                    r"\[16, 64\] there, \[32, 64\] in this run's model \(settings "
                                                    r"changed: model.flavor 'a' -> 'b'\); nothing was loaded or set "
                                                    r"aside"):
        other_mgr.load()
    real = ckpt.model_mismatch  # a mismatch the key check missed fails in DCP's load: still not damage
    ckpt.model_mismatch = lambda path, shapes: None
    try:
        with pytest.raises(SettingsMismatchError, match=r"step-1 is good but does not fit this run's model: loading "
                                                        r"failed on a mismatch: .*nothing was loaded or set aside"):
            other_mgr.load()
    finally:
        ckpt.model_mismatch = real

    def refuse(saved):
        raise ConfigError(f"trained with {saved}")

    mgr.check_settings = refuse  # the saved settings are compared before the load
    scramble(model)
    with pytest.raises(ConfigError, match=r"trained with \{'model.flavor': 'a'\}"):
        mgr.load()
    assert all((p == 0.5).all() for p in snapshot(model).values())  # nothing was loaded
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1"]
    mgr.check_settings = None
    assert mgr.load() == 1
    assert_equal(snapshot(model), good, "param")


# -- a code error on load is not damage (issue 43, item 4) ---------------------------------------

def _tree_hashes(folder) -> dict:
    import hashlib

    return {os.path.relpath(os.path.join(d, f), folder): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(folder) for f in files}


def _worker_code_error_on_load(folder):
    """A verified checkpoint whose load fails in the code (planted after DCP's read, as fused AdamW refusing a
    layout's parameters did while the optimizer state was set up) stops the load on every rank with one line;
    every file keeps its name and its sha256. A failed file read is still damage, set aside."""
    from titan_ulysses.checkpoint.fit import LoadCodeError

    model, opt, loader, _, mgr = checkpoint_setup(folder)
    for step in (1, 2):
        tiny_train_step(model, opt)
        loader.n = step
        mgr.save(step)
    dist.barrier()
    before = _tree_hashes(folder)
    real = ckpt.dcp.load

    def code_error_after(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("planted: aten._fused_adamw_.default got mixed torch.Tensor and DTensor")

    def code_error_before(*args, **kwargs):
        raise TypeError("planted: an argument the loader does not take")

    for planted in (code_error_after, code_error_before):
        ckpt.dcp.load = planted
        try:
            with pytest.raises(LoadCodeError, match=r"^checkpoint .*step-2 passed verification, but loading it failed "
                                                    r"in the code, not in its files \((RuntimeError|TypeError): "
                                                    r"planted: [^\n]*\); nothing was set aside, renamed or changed"):
                mgr.load()
        finally:
            ckpt.dcp.load = real
        dist.barrier()
        assert _tree_hashes(folder) == before, planted.__name__  # no file renamed (.bad) or changed
        dist.barrier()

    def read_error(*args, **kwargs):  # a file read failing after verification: damage, set aside
        raise OSError(5, "Input/output error", os.path.join(args[1] if len(args) > 1 else folder, "__0_0.distcp"))

    ckpt.dcp.load = lambda state, checkpoint_id, **kw: (read_error() if checkpoint_id.endswith("step-2")
                                                         else real(state, checkpoint_id=checkpoint_id, **kw))
    try:
        assert mgr.load() == 1
    finally:
        ckpt.dcp.load = real
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1", "step-2.bad"]


def test_a_code_error_on_load_sets_nothing_aside(tmp_path):
    run_distributed(_worker_code_error_on_load, 2, str(tmp_path / "ckpt"))
