"""Tokenizers: byte-level (no file) and tiktoken BPE in Llama-3's tokenizer.model format."""

from __future__ import annotations

import os

from titan_ulysses.models.llama.args import BYTE_VOCAB_SIZE


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS 256, EOS 257, PAD 258; vocab rounded up to 264."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Llama 3's pre-tokenisation pattern (part of the tokenizer format).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NUM_SPECIAL = 256


class TiktokenTokenizer:
    """BPE ranks from a Llama-3 ``tokenizer.model`` (base64 token, rank per line) + 256 special tokens."""

    def __init__(self, path: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"model.tokenizer_path {path!r} is not a readable file (a Llama-3 tokenizer.model)")
        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as e:
            raise ValueError(f"model.tokenizer_path {path!r} is not a tiktoken BPE file: {e}") from e
        n = len(ranks)
        names = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(_NUM_SPECIAL - 2)
        ]
        special = {name: n + i for i, name in enumerate(names)}
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        self.bos_id, self.eos_id = special["<|begin_of_text|>"], special["<|end_of_text|>"]
        self.pad_id = self.eos_id
        self.vocab_size = n + _NUM_SPECIAL

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._enc.encode(text, disallowed_special=())
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self._enc.decode([i for i in ids if i < self.vocab_size - _NUM_SPECIAL])


def build_tokenizer(kind: str, path: str = ""):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return TiktokenTokenizer(path)
    if kind == "hf":  # path: a tokenizer.json or its folder
        from titan_ulysses.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(path)
    raise ValueError(f"model.tokenizer {kind!r} is not one of ['byte', 'tiktoken', 'hf']")
