"""Run a function on N gloo processes and fail the test if any rank fails."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn, world_size: int, init_file: str, args: tuple) -> None:
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


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(*args)`` on ``world_size`` freshly spawned gloo ranks (``fn`` must be importable).

    A deadlock fails the test after ``TIMEOUT_S`` seconds instead of hanging CI.
    """
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "store")
        ctx = mp.spawn(_worker, args=(fn, world_size, init_file, args), nprocs=world_size, join=False)
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
