"""Long documents tokenized in bounded pieces, with exactly the ids of one call on the whole text.

A Hugging Face tokenizer holds about 240 bytes of host memory per character it encodes at
once (offsets, token strings, alignments): a 50 MB single-line jsonl peaked at 9.3 GB.
``encode_document`` cuts a text longer than ``PIECE_CHARS`` at *safe boundaries* and
concatenates the pieces' ids (int32), so the tokenizer never sees more than a piece.

Where a cut is safe depends on the tokenizer (its ``cut_rule``):

* ``"any"`` (the byte tokenizer): ids are per UTF-8 byte, any character boundary is safe.
* ``"space"``: just before an ASCII space that follows an ASCII letter, with no added token
  within reach. This holds for the pre-tokenizer regexes of GPT-2 (``ByteLevel``), Llama 3
  (tiktoken, and ``Split`` in tokenizer.json) and Qwen 2 (``KNOWN_PATTERNS``), with no
  normalizer or NFC. In each regex, every alternative that matches a letter ends at the end of
  a run of letters (or inside it: the contractions), so the pre-token holding the letter ends
  at the space; the regex has no lookbehind, so the text after the cut splits as in the whole;
  the piece before the cut ends in letters, where no lookahead (``\\s+(?!\\S)``) is involved.
  The model (BPE) runs per pre-token; NFC never composes an ASCII letter with a space; an
  added token (matched first, possibly absorbing spaces) is kept away from the cut.
* ``None``: no cut is proven (e.g. a SentencePiece-style tokenizer.json with no
  pre-tokenizer): a document is tokenized whole up to ``MAX_WHOLE_CHARS`` and refused above.

``tests/test_long_documents.py`` checks the equality on adversarial and random texts.
"""

from __future__ import annotations

import numpy as np

from titan_ulysses.data.sources import DataError

PIECE_CHARS = 1 << 18
"""Characters the tokenizer sees at once (about 60 MB of a Hugging Face tokenizer's memory)."""
MAX_WHOLE_CHARS = 1 << 23
"""Longest text tokenized in one call when no safe cut is found (about 2 GB of host memory)."""
BYTES_PER_CHAR = 240
"""Host memory of a Hugging Face tokenizer per character encoded at once (measured, byte-level BPE)."""
# pre-tokenizer regexes (tokenizer.json ``Split``) for which the "space" rule is proven
KNOWN_PATTERNS = (
    # Llama 3 (also the tiktoken tokenizer.model's, data/tokenizer.py)
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    # Qwen 2 / 2.5 / 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


def hf_cut_rule(spec: dict) -> str | None:
    """"space" when a tokenizer.json (parsed) is one this module's proof covers, else None."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return None
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel" and steps[0].get("use_regex", True):
        return "space"  # GPT-2's regex inside ByteLevel
    if len(steps) == 2 and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True):
        split = steps[0]
        if (split.get("type") == "Split" and split.get("pattern", {}).get("Regex") in KNOWN_PATTERNS
                and split.get("behavior") == "Isolated" and not split.get("invert")):
            return "space"
    return None


def _ascii_letter(c: str) -> bool:
    return "a" <= c <= "z" or "A" <= c <= "Z"


def _safe(text: str, i: int, added: tuple[str, ...], reach: int) -> bool:
    if not (text[i] == " " and _ascii_letter(text[i - 1])):
        return False
    near = text[max(0, i - reach):i + reach]
    return not any(token in near for token in added)


def _cut(text: str, start: int, rule: str, added: tuple[str, ...]) -> int | None:
    """Where the piece starting at ``start`` ends: at most ``PIECE_CHARS`` on, else the first safe cut
    within ``MAX_WHOLE_CHARS``; None when there is none."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    if rule == "any":
        return end
    reach = max(map(len, added), default=0) + 1
    i = text.rfind(" ", start + 1, end + 1)
    while i > start:
        if _safe(text, i, added, reach):
            return i
        i = text.rfind(" ", start + 1, i)
    limit = min(len(text), start + MAX_WHOLE_CHARS)
    i = text.find(" ", end, limit)
    while i != -1:
        if _safe(text, i, added, reach):
            return i
        i = text.find(" ", i + 1, limit)
    return len(text) if len(text) - start <= MAX_WHOLE_CHARS else None


def encode_document(tokenizer, text: str, where, bos: bool = True, eos: bool = True):
    """``tokenizer.encode(text, bos, eos)``, its tokenizer never holding more than a piece of a long text.

    Short texts return the tokenizer's own list; long ones an int32 array of the same ids.
    A DataError naming ``where`` refuses a text that cannot be cut and is over ``MAX_WHOLE_CHARS``.
    """
    if len(text) <= PIECE_CHARS:
        return tokenizer.encode(text, bos, eos)
    rule = getattr(tokenizer, "cut_rule", None)
    added = tuple(getattr(tokenizer, "added_texts", ()))
    pieces, start = [np.asarray([tokenizer.bos_id] * bos, dtype=np.int32)], 0
    while start < len(text):
        end = _cut(text, start, rule, added) if rule else (len(text) if len(text) <= MAX_WHOLE_CHARS else None)
        if end is None:
            why = ("no ASCII letter before a space to cut it at" if rule else
                   "this tokenizer's pre-tokenizer gives no place where a cut keeps the same token ids")
            raise DataError(
                f"{where}: a document of {len(text):,} characters, and {why} within {MAX_WHOLE_CHARS:,} characters; "
                f"tokenized whole it would take about {len(text) * BYTES_PER_CHAR / 2**30:.0f} GB of host memory; "
                f"split it into rows of at most {MAX_WHOLE_CHARS:,} characters")
        pieces.append(np.asarray(tokenizer.encode(text[start:end], False, False), dtype=np.int32))
        start = end
    pieces.append(np.asarray([tokenizer.eos_id] * eos, dtype=np.int32))
    return np.concatenate(pieces)
