"""A file's content as a digest: what a tokenizer's fingerprint is made of (``data/tokenizer.py``'s tiktoken
file, ``interop/hf_tokenizer.py``'s tokenizer.json), here so both import it and neither imports the other back."""

from __future__ import annotations

import hashlib


def file_digest(path: str) -> str:
    """sha256 of a file's content (tokenizer files are a few MB: read whole, once per run)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
