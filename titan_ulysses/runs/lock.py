"""One run per dump folder: a lock that rank 0 holds for the life of the run.

Two runs in one ``job.dump_folder`` (a relaunch while the old ranks still run) delete each
other's unfinished saves and interleave their ``metrics.jsonl``. The lock is
``{dump_folder}/.run.lock``:

* an ``flock`` on it, which the kernel drops when the holder exits or dies (the file stays;
  it is the ``flock``, not the file, that holds the folder), so a crashed run never leaves
  a stale lock; NFSv4 and Lustre (mounted with ``flock``) honour it across hosts;
* inside, who holds it (host, pid, start time), for the refusal message;
* where the filesystem has no ``flock`` (it answers ENOLCK / EOPNOTSUPP), the file's content
  decides: a holder on this host whose pid is gone (or reused) is stale; a holder on another
  host is stale once its heartbeat (the file's mtime, touched every ``HEARTBEAT_S``) is older
  than ``STALE_AFTER_S``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time

from titan_ulysses.checkpoint.errors import RunRefused

LOCK_NAME = ".run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FolderInUseError(RunRefused):
    """Another live run holds the dump folder (or the checkpoint folder)."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has exited
    except (OSError, IndexError):
        return None


def _alive_here(holder: dict) -> bool:
    pid = int(holder.get("pid", -1))
    started = _start_time(pid) if pid > 0 else None
    return started is not None and str(holder.get("pid_start")) in (started, "None")


def describe(holder: dict | None) -> str:
    if not holder:
        return "a run that did not say who it is"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"


class RunLock:
    def __init__(self, folder: str, setting: str = "job.dump_folder"):
        self.folder = folder
        self.setting = setting  # what the refusal names
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd = None
        self._stop = threading.Event()

    def _read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.loads(f.read() or "null")
        except (OSError, ValueError):
            return None

    def _refuse(self, holder: dict | None) -> FolderInUseError:
        return FolderInUseError(
            f"{self.setting} {self.folder} is in use by another run ({describe(holder)}; lock {self.path}); "
            f"stop that run or choose another {self.setting}"
        )

    def _stale(self, holder: dict | None) -> bool:
        if not holder:
            return True
        if holder.get("host") == socket.gethostname():
            return not _alive_here(holder)
        try:
            return time.time() - os.path.getmtime(self.path) > STALE_AFTER_S
        except OSError:
            return True

    def acquire(self) -> str | None:
        """Take the lock or raise FolderInUseError; returns a note when a stale lock was taken over."""
        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        note = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise self._refuse(self._read()) from None
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            holder = self._read()  # no flock on this filesystem: the content decides
            if holder and not self._stale(holder):
                os.close(fd)
                raise self._refuse(holder) from None
            if holder:
                note = f"took over the stale lock of {describe(holder)} ({self.path})"
            self._heartbeat()
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return note

    def _heartbeat(self) -> None:
        def beat():
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    os.utime(self.path)
                except OSError:
                    pass

        threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True).start()

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        try:
            os.ftruncate(self._fd, 0)  # nobody holds it now
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
