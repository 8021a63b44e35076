"""Joining the job and laying its ranks out: the process group, then the DeviceMesh.

Two calls, not one, because the checks that need the device type (attention backends, the
memory warning; ``preflight.check_device``) run between them, before any mesh collective.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.watchdog import exit_with_launcher, set_timeouts


def init_distributed(fake_world_size: int = 0, timeout_seconds: float | None = None) -> torch.device:
    """Join the torchrun job (or run as a world of one); NCCL on CUDA, gloo on CPU.

    With ``fake_world_size`` > 0, become rank 0 of that many ranks on PyTorch's fake
    process group (collectives return at once and move no data). ``timeout_seconds``
    bounds the rendezvous and every collective until ``set_timeouts`` changes it.
    """
    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if fake_world_size and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world_size)
    if not dist.is_initialized():
        device_id = device if device.type == "cuda" else None
        if "MASTER_ADDR" in os.environ:  # torchrun's rendezvous
            dist.init_process_group(backend, device_id=device_id, timeout=timeout)
        else:  # plain `python train.py`: a world of one, in-process (no port for two such runs to collide on)
            os.environ.update(RANK="0", WORLD_SIZE="1")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id,
                                    timeout=timeout)
    return device


def join_job(config) -> torch.device:
    """This rank's device, in the job's process group (``comm.mode`` 'fake': a simulated rank 0);
    a rank whose launcher dies exits with it (``watchdog.py``)."""
    fake = config.comm.mode == "fake"
    exit_with_launcher()
    return init_distributed(config.comm.fake_world_size if fake else 0, config.comm.init_timeout_seconds)


def build_mesh(config, parallel_dims: ParallelDims, device: torch.device) -> None:
    """The DeviceMesh of ``parallel_dims`` on ``device``'s type; its groups get the start-up timeout
    (new groups take gloo's 30-minute default otherwise)."""
    parallel_dims.build_mesh(device.type)
    if config.comm.mode != "fake":
        set_timeouts(config.comm.init_timeout_seconds)


def leave_job(code: int) -> None:
    """End a command's process: leave the process group together, then exit without interpreter teardown.

    After a success every rank meets at a barrier before destroying its groups: a rank that destroys its
    gloo groups while a peer still talks to it aborts ("terminate called without an active exception").
    ``os._exit`` skips interpreter and C++ static teardown, where a still-joinable gloo thread aborts the
    process now and then (exit -6) after the work is done, which torchrun reports as a failure. Never returns.
    """
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
