"""What ends a job that cannot go on: collective timeouts, and ranks whose launcher died.

Timeouts (torchtitan's ``comm.init_timeout_seconds`` / ``comm.train_timeout_seconds``):
every process group gets the init timeout until the first step is done (start-up and
compilation are slow), then the shorter train timeout, so a frozen or dead rank makes its
peers' next collective fail within minutes, not after gloo's 30-minute default (new
groups, those of the DeviceMesh included, take that default, not the default group's).
The checkpoint manager's group keeps the longer timeout: writing a checkpoint takes a while.

Launcher death: ranks started by torchrun keep running when torchrun itself is killed
(SIGKILL, an OOM kill), and a relaunch then races them in the same folder. Each rank
watches its parent; when it is gone, the rank sends itself SIGTERM, which the trainer turns
into "save at the end of this step (or the next) and exit" (any rank's signal stops all of them).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def set_timeouts(seconds: float, exclude=()) -> int:
    """Give every process group of this rank the collective timeout ``seconds``; returns how many."""
    timeout = datetime.timedelta(seconds=seconds)
    excluded = {id(g) for g in exclude if g is not None}
    count = 0
    for group in list(c10d._world.pg_map):
        if id(group) in excluded or group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, RuntimeError, AttributeError):
            continue  # a backend without settable timeouts (the fake group of comm.mode 'fake')
        count += 1
    return count


def exit_with_launcher(poll_seconds: float = 2.0, force: bool = False) -> threading.Thread | None:
    """Under torchrun (or with ``force``), SIGTERM this process once its parent process is gone.

    Not under a plain ``python train.py``: there the parent is a shell, which may well exit
    (``nohup``) while the run should go on.
    """
    if not force and "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()

    def watch():
        stop = threading.Event()
        while not stop.wait(poll_seconds):
            if os.getppid() != parent:
                print(f"rank {os.environ.get('RANK', '?')}: the launcher (pid {parent}) is gone; saving at the end "
                      f"of this step and exiting", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="exit-with-launcher", daemon=True)
    thread.start()
    return thread
