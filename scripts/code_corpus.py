"""Write source files as a text corpus: one ``{"text", "path"}`` row per file, split by file into train and held-out.

    python scripts/code_corpus.py OUT [PATH ...] [--held-out-every 8] [--suffix .py]

PATH (default: this repository's ``titan_ulysses`` package, the project's own BSD-3 code,
about 600 KB) are files or folders searched recursively for ``--suffix`` files. A file is
held out when the first byte of the SHA-1 of its path (relative to the repository) is a
multiple of ``--held-out-every``: a split that stays put as files are added or removed.
Writes ``OUT/train.jsonl`` and ``OUT/heldout.jsonl`` (``training.dataset = "text"`` reads the
``text`` field) and prints how many files and characters each holds. A continued-pretraining
corpus of real code on any machine, with nothing to download.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_files(paths: list[str], suffix: str) -> list[str]:
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(suffix)]
    return files


def held_out(path: str, every: int) -> bool:
    return hashlib.sha1(path.encode()).digest()[0] % every == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder for train.jsonl and heldout.jsonl")
    p.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "titan_ulysses")])
    p.add_argument("--held-out-every", type=int, default=8, help="about one file in this many is held out")
    p.add_argument("--suffix", default=".py")
    a = p.parse_args(argv)
    missing = [x for x in a.paths if not os.path.exists(x)]
    if missing or a.held_out_every < 2:
        print(f"code_corpus: {f'{missing[0]!r} does not exist' if missing else '--held-out-every must be >= 2'}",
              file=sys.stderr)
        return 2
    rows = {"train": [], "heldout": []}
    for f in source_files(a.paths, a.suffix):
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        if text.strip():
            rel = os.path.relpath(os.path.abspath(f), ROOT)
            rows["heldout" if held_out(rel, a.held_out_every) else "train"].append({"text": text, "path": rel})
    if not rows["train"] or not rows["heldout"]:
        print(f"code_corpus: {sum(map(len, rows.values()))} {a.suffix} file(s) give an empty split; give more files",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    for split, items in rows.items():
        with open(os.path.join(a.out, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in items)
    print("wrote " + ", ".join(f"{a.out}/{s}.jsonl ({len(r)} files, {sum(len(x['text']) for x in r) // 1000} K chars)"
                               for s, r in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
