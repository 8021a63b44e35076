"""Run a function on N gloo processes and fail the test if any rank fails.

Ranks are forked from a forkserver that has imported torch and this package once
(``PRELOAD``), rather than spawned as fresh interpreters that each import them again: on
2 cores a 4-rank launch takes about 0.2 s instead of 5-10 s, and the suite launches ranks
over a hundred times. Each rank is still a fresh process forked from the same untouched
server (nothing in it has run a kernel, started a thread pool or made a process group),
so no state passes from one test to the next; ``fn`` and its arguments are pickled as
with spawn. A forked rank would write to the server's stdout and stderr, those of the test
that happened to start it; each rank is handed this process's current ones instead, so
that ``capfd`` sees what the ranks print, as it did with spawn. One difference remains:
ranks get the environment the server started with, so a test that needs an environment
variable in its ranks must set it inside ``fn`` (none does today).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import reduction


class _ParentFd:
    """This process's file descriptor ``fd``, duplicated into the rank when the rank's
    arguments are pickled (the way multiprocessing hands pipes to its children)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup) -> int:
    return dup.detach()


def _worker(rank: int, fn, world_size: int, init_file: str, args: tuple, out: int, err: int) -> None:
    os.dup2(out, 1)
    os.dup2(err, 2)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    fn(*args)
    # tear down together: a rank that destroys its gloo groups while a peer still talks
    # to it aborts the process ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    # Leave without running interpreter and C++ static teardown: a gloo thread still
    # joinable there aborts the process now and then ("terminate called without an active
    # exception", seen once in ~140 CI tests) after the test itself has passed. A failing
    # ``fn`` raised above, which mp.spawn reports as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


TIMEOUT_S = 300
# imported once by the forkserver (a module that fails to import is skipped, not fatal)
PRELOAD = ["torch", "torch.distributed", "titan_ulysses.trainer", "dist_utils", "model_harness",
           # test_hf_ulysses' ranks build these transformers decoders: 2 s of imports once, not in each of its ranks
           "titan_ulysses.integrations.transformers", *(f"transformers.models.{m}.modeling_{m}" for m in
                                                         ("llama", "qwen3", "mistral", "gemma3", "qwen3_moe", "olmo2"))]
multiprocessing.set_forkserver_preload(PRELOAD)


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(*args)`` on ``world_size`` fresh gloo ranks (``fn`` must be importable).

    A deadlock fails the test after ``TIMEOUT_S`` seconds instead of hanging CI.
    """
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "store")
        std = (_ParentFd(1), _ParentFd(2))
        ctx = mp.start_processes(_worker, args=(fn, world_size, init_file, args, *std), nprocs=world_size,
                                 join=False, start_method="forkserver")
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {TIMEOUT_S}s (deadlock?)")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol=1e-5, atol=1e-5) -> None:
    """fp32 comparison; atol is scaled by the reference's magnitude so tiny gradients are still checked."""
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")
