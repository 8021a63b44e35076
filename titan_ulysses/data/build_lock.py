"""One builder per token-store key at a time, and no leftovers of builders that are gone.

A build of ``{cache_dir}/{key}`` holds an exclusive ``flock`` on ``{cache_dir}/{key}.lock``
(rank 0 of a node's builders, or ``prepare_data.py``'s parent process). A second job
building the same new corpus waits for it and then opens the finished store; the kernel
drops the lock of a killed builder, so a lock is never stale. While it holds the lock, a
builder removes what dead builders left: this key's ``.tmp-*`` folders and its ``.parts-*``
folders of another cut of the corpus (parts of the same cut are whole and reused), and the
``.parts-*`` / ``.tmp-*`` folders of any other key whose lock nobody holds.

The lock file is removed once the store exists (a late waiter that still locks the removed
file finds the store and builds nothing); after a failed build it stays, a few bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil

_LITTER = re.compile(r"^(?P<key>[0-9a-f]+)\.(parts|tmp)-")


class BuildLock:
    def __init__(self, final: str):
        self.final, self.path, self.fd = final, f"{final}.lock", None

    def acquire(self, say=None) -> "BuildLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say is not None:
                say(f"waiting for another process building the token store {self.final}")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            import sys

            print(f"warning: the file system of {self.path} has no file locks ({e.strerror}): builds of this token "
                  f"store by several jobs at once are not coordinated; start one job (or prepare_data.py) first",
                  file=sys.stderr, flush=True)
        return self

    def release(self, built: bool) -> None:
        if self.fd is None:
            return
        if built:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None


def _unheld(cache_dir: str, key: str) -> bool:
    """Nobody builds ``key`` now (its lock is free, or it has none: a builder that is gone)."""
    path = os.path.join(cache_dir, f"{key}.lock")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def remove_litter(cache_dir: str, key: str, keep: str) -> list[str]:
    """Remove the leftovers of dead builders (see the module docstring); ``keep`` is this
    build's own parts folder. Call with ``key``'s lock held. Returns what it removed."""
    removed = []
    for name in sorted(os.listdir(cache_dir)):
        match = _LITTER.match(name)
        path = os.path.join(cache_dir, name)
        if match is None or path == keep or not os.path.isdir(path):
            continue
        if match["key"] == key or _unheld(cache_dir, match["key"]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def write_error(error: OSError, where: str, needed: int) -> str:
    """One line for a failed write into the token cache: free versus needed space when the disk is full."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(os.path.dirname(where) or ".").free
        return (f"no space left for the token store {where}: {_size(free)} free, about {_size(needed)} needed "
                f"(estimate: parts and the merged store); free space or set training.dataset_cache_dir to a larger disk")
    return f"cannot write the token store {where}: {error.strerror or error}"
