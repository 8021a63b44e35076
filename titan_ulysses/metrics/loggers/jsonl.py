"""``metrics.jsonl`` (and ``summary.json`` at the end) in the dump folder.

``metrics.jsonl`` only ever holds whole lines: each line is appended in one write, and a
write that fails (a full disk) is cut back off, with an error naming the file and the
space it needed; a partial last line left by an older crash is dropped at start-up.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys


class JsonlLogger:
    def __init__(self, dump_folder: str):
        self.path = os.path.join(dump_folder, "metrics.jsonl")
        self.summary_path = os.path.join(dump_folder, "summary.json")
        _drop_partial_line(self.path)

    def log(self, metrics: dict) -> None:
        append_line(self.path, json.dumps(metrics))

    def log_summary(self, summary: dict) -> None:
        tmp = self.summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, self.summary_path)

    def close(self) -> None:
        pass


def append_line(path: str, line: str) -> None:
    """Append ``line`` and a newline to ``path`` whole, or raise OSError and leave the file as it was."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")
        except OSError as e:
            try:
                os.ftruncate(fd, start)  # never leave half a line
            except OSError:
                pass
            free = shutil.disk_usage(os.path.dirname(path) or ".").free
            raise OSError(e.errno, f"cannot append a line of {len(data)} bytes to {path} ({e.strerror or e}; "
                                   f"{free} bytes free on that filesystem)") from e
    finally:
        os.close(fd)


def _drop_partial_line(path: str) -> None:
    """Cut a last line without its newline (a crash mid-write by an older version) off ``path``."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                f.truncate(keep)
                print(f"warning: dropped a partial last line of {path} ({len(data) - keep} bytes)",
                      file=sys.stderr, flush=True)
    except FileNotFoundError:
        pass
