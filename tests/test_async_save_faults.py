"""Issue 33 ('not yet tried'): kill -9 and a full disk during an *asynchronous* save. The last good
checkpoint stays loadable and a resume (new processes, as a rerun is) picks it, bit-exact.

How the faults are made, on 2 gloo ranks (async_mode "async": the state is staged in ``save()``
and written from DCP's background thread):

* kill -9: DCP's file system layer is wrapped so that, in the background thread, after the first
  bytes of the new step's shard are on disk, each rank sends itself SIGKILL: the process ends there
  with no handler, no ``finally`` and no flush, as ``kill -9`` (or the OOM killer) does. (A kill
  between the write and the commit's rename is the exception-based case of
  ``test_checkpoint_trust.py``: nothing is renamed before the manifest is complete.)
* a full disk: the same layer writes part of the shard and then raises ``OSError(ENOSPC)``, what a
  ``write()`` on a full file system returns (the kernel writes what fits, then fails). A tmpfs of a
  few KiB would be the literal fault, but mounting one needs root, which CI does not have; this is
  the error the writer sees from it. Only rank 1's disk fills (a node-local disk), so rank 0 learns
  of the failure through DCP's gather of the write results.
"""

import contextlib
import errno
import os
import signal

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from helpers import assert_equal, checkpoint_setup, snapshot, tiny_train_step
from titan_ulysses.checkpoint.manager import complete_steps


@contextlib.contextmanager
def _faulty_writes(step, fault, ranks=(0, 1)):
    """DCP's file streams for ``step-{step}.tmp``: write some bytes, then ``fault()`` (on ``ranks``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def stream(self, path, mode):
        with real(self, path, mode) as f:
            if f"step-{step}.tmp" in str(path) and "w" in mode and dist.get_rank() in ranks:
                f.write(b"the first bytes of a shard")
                f.flush()
                fault()
            yield f

    FileSystem.create_stream = stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


def _sigkill():
    os.kill(os.getpid(), signal.SIGKILL)


def _good_then_killed(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode="async")
    tiny_train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    mgr.wait()  # step-1 committed
    good = snapshot(model)
    if dist.get_rank() == 0:
        torch.save(good, os.path.join(folder, "..", "good.pt"))
    dist.barrier()
    tiny_train_step(model, opt)
    loader.n = 2
    with _faulty_writes(2, _sigkill):
        mgr.save(2)  # staged here; the background thread writes, and is killed mid-shard
        mgr.wait()
    raise AssertionError("not killed")


def _resume(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode="async")
    assert mgr.load() == 1 and loader.n == 1
    assert_equal(snapshot(model), torch.load(os.path.join(folder, "..", "good.pt")), "param")
    dist.barrier()
    assert sorted(os.listdir(folder)) == ["step-1"]  # the half-written step-2.tmp was removed at start-up
    tiny_train_step(model, opt)
    loader.n = 2
    mgr.save(2)
    mgr.close()
    assert complete_steps(folder) == [1, 2] and mgr.verify(os.path.join(folder, "step-2")) is None


def test_kill_9_during_an_async_save_resumes_from_the_last_good_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpt")
    with pytest.raises(Exception, match="SIGKILL|signal 9"):
        run_distributed(_good_then_killed, 2, folder)
    assert complete_steps(folder) == [1] and os.path.isdir(os.path.join(folder, "step-2.tmp"))
    run_distributed(_resume, 2, folder)


def _full_disk(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode="async")
    tiny_train_step(model, opt)
    loader.n = 1
    mgr.save(1)
    mgr.wait()
    good = snapshot(model)
    if dist.get_rank() == 0:
        torch.save(good, os.path.join(folder, "..", "good.pt"))

    def no_space():
        raise OSError(errno.ENOSPC, "No space left on device")

    tiny_train_step(model, opt)
    loader.n = 2
    with _faulty_writes(2, no_space, ranks=(1,)):
        mgr.save(2)  # returns at once: the write runs in the background
        # the failure surfaces where the save is finished (the next save, wait() or close()), on every rank
        with pytest.raises(OSError, match=r"^\[Errno 28\] no space left on device while saving .*step-2\.tmp: a "
                                          r"checkpoint of this run needs about .*; the newest good checkpoint, "
                                          r".*step-1, is kept\. Free .* or point checkpoint.folder at a filesystem with "
                                          r"room \(keep_latest_k cannot help: the folder holds 1 checkpoint and"):
            mgr.wait()
    assert complete_steps(folder) == [1]
    assert mgr.load() == 1 and loader.n == 1  # the same run goes on from it
    assert_equal(snapshot(model), good, "param")
    tiny_train_step(model, opt)  # and saves again once there is space
    loader.n = 3
    mgr.save(3)
    mgr.close()
    assert complete_steps(folder) == [1, 3]


def _resume_after_full_disk(folder):
    model, opt, loader, _, mgr = checkpoint_setup(folder, async_mode="async")
    assert mgr.load() == 3 and loader.n == 3


def test_a_full_disk_during_an_async_save_keeps_the_last_good_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpt")
    run_distributed(_full_disk, 2, folder)
    run_distributed(_resume_after_full_disk, 2, folder)
