"""Tokenizers: byte-level (no file), tiktoken BPE in Llama-3's tokenizer.model format, and a
Hugging Face tokenizer.json (``hf_tokenizer.py``).

``resolve_tokenizer(model_config)`` is "this run's tokenizer": train.py, the trainer,
scripts/prepare_data.py and the eval scripts all build it through this one function, so
they read the same file and name the same setting when it is wrong. Every tokenizer has a
``fingerprint`` (a hash of its file's content and its special ids), which keys the token
store: two spellings of one file share a store, a changed file at the same path does not.
"""

from __future__ import annotations

import os

from titan_ulysses.data.digest import file_digest
from titan_ulysses.data.sources import DataError
from titan_ulysses.interop.hf_tokenizer import HFTokenizer
from titan_ulysses.models.flavors import BYTE_VOCAB_SIZE


class TokenizerError(DataError):
    """The tokenizer file (or the setting naming it) is wrong: one line naming the setting."""


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS 256, EOS 257, PAD 258; vocab rounded up to 264."""

    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = BYTE_VOCAB_SIZE
    folder = ""  # no file: chat templates come from training.chat_template or ChatML
    special_tokens: dict = {}  # no token strings a chat template could emit
    cut_rule = "any"  # a long text may be tokenized in pieces cut anywhere (data/long_documents.py)

    @property
    def fingerprint(self) -> str:
        return "byte"

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

    cut_rule = "space"  # Llama 3's regex, special tokens never matched in text (data/long_documents.py)

    def __init__(self, path: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"model.tokenizer_path {path!r} is not a readable file (a Llama-3 tokenizer.model)")
        try:
            ranks = load_tiktoken_bpe(path)
        except Exception as e:
            raise ValueError(f"model.tokenizer_path {path!r} is not a tiktoken BPE file "
                             f"(lines of 'base64-token rank'): {type(e).__name__}: {e}") from e
        if not ranks or sorted(ranks.values()) != list(range(len(ranks))):
            raise ValueError(f"model.tokenizer_path {path!r} is not a tiktoken BPE file: its ranks are not "
                             f"0..n-1 (a Llama-3 tokenizer.model has one 'base64-token rank' per line)")
        self.path, self.folder = path, os.path.dirname(os.path.abspath(path))
        self._fingerprint = None
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
        self.special_tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = "tiktoken-" + file_digest(self.path)
        return self._fingerprint

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._enc.encode(text, disallowed_special=())
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self._enc.decode([i for i in ids if i < self.vocab_size - _NUM_SPECIAL])


def tokenizer_kind(model) -> str:
    """``model.tokenizer``, or for "" (the default) "hf" when the model's Hugging Face folder has a
    tokenizer.json, else "byte": a folder's own tokenizer is used unless another is asked for."""
    if model.tokenizer:
        return model.tokenizer
    folder = model.tokenizer_path or model.hf_assets_path
    return "hf" if folder and os.path.isfile(os.path.join(folder, "tokenizer.json")) else "byte"


def tokenizer_source(model) -> tuple[str, str, str]:
    """(kind, path, the setting that names the path) of ``model`` (a ModelConfig): the one place
    that says where a run's tokenizer comes from."""
    kind = tokenizer_kind(model)
    if kind == "hf":
        if model.tokenizer_path:
            return "hf", model.tokenizer_path, "model.tokenizer_path"
        return "hf", model.hf_assets_path, "model.hf_assets_path"
    if kind == "tiktoken":
        return "tiktoken", model.tokenizer_path, "model.tokenizer_path"
    return kind, "", "model.tokenizer"


def resolve_tokenizer(model):
    """This run's tokenizer, from ``model`` (a ModelConfig); a TokenizerError (one line naming
    the setting and the file) when it cannot be read."""
    kind, path, setting = tokenizer_source(model)
    if kind in ("hf", "tiktoken") and not path:
        raise TokenizerError(f"model.tokenizer {kind!r} needs {'model.hf_assets_path or ' if kind == 'hf' else ''}"
                             f"model.tokenizer_path")
    try:
        return build_tokenizer(kind, path)
    except (OSError, ValueError) as e:
        message = str(e)
        raise TokenizerError(message if message.startswith(setting) else f"{setting} {path!r}: {message}") from e


def build_tokenizer(kind: str, path: str = ""):
    if kind == "byte":
        return ByteTokenizer()
    if kind == "tiktoken":
        return TiktokenTokenizer(path)
    if kind == "hf":  # path: a tokenizer.json or its folder
        return HFTokenizer(path)
    raise ValueError(f"model.tokenizer {kind!r} is not one of ['byte', 'tiktoken', 'hf']")
