"""A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (model.tokenizer = "hf").

Ids are those of ``transformers.AutoTokenizer`` on the same folder with
``add_special_tokens=False``; BOS and EOS are added by ``encode`` itself, from
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``) or else from
``config.json`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``). A tokenizer_config.json
that disagrees with tokenizer.json (a special token or an ``added_tokens_decoder`` entry that
tokenizer.json does not have at that id) is refused, naming the file and field. Families without a
BOS token (Qwen) start documents with their EOS token, the document separator they were
pretrained with; PAD falls back to EOS (padded positions carry no loss anyway).
"""

from __future__ import annotations

import json
import os

from titan_ulysses.data.digest import file_digest
from titan_ulysses.data.long_documents import hf_cut_rule


def hf_tokenizer_file(path: str) -> str:
    """The tokenizer.json of ``path`` (the file itself or its folder); FileNotFoundError naming it otherwise."""
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no tokenizer.json at {file!r}")
    return file


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def _token_text(entry) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (both spellings occur in tokenizer_config.json)."""
    if isinstance(entry, dict):
        return entry.get("content")
    return entry


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = hf_tokenizer_file(path)
        folder = os.path.dirname(os.path.abspath(file))
        self.file, self.folder, self._fingerprint = file, folder, None
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the Rust library raises a bare Exception
            raise ValueError(f"{file} is not a valid tokenizer.json ({e}); copy it again from the model's "
                             f"Hugging Face folder") from e
        spec = json.loads(self._tok.to_str())
        self.cut_rule = hf_cut_rule(spec)  # where a long text may be cut (data/long_documents.py)
        self.added_texts = tuple(t["content"] for t in spec.get("added_tokens") or [])
        self._tok_config_path = os.path.join(folder, "tokenizer_config.json")
        tok_config = _read_json(self._tok_config_path)
        model_config = _read_json(os.path.join(folder, "config.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._check_added_tokens(tok_config)
        ids = {name: self._special(tok_config, model_config, name) for name in ("bos", "eos", "pad")}
        if ids["eos"] is None:
            raise ValueError(f"{folder!r}: no EOS token (tokenizer_config.json has no eos_token of this "
                             f"tokenizer.json and config.json has no eos_token_id); set one of them")
        self.has_bos = ids["bos"] is not None
        self.eos_id = ids["eos"]
        self.bos_id = ids["bos"] if self.has_bos else self.eos_id
        self.pad_id = ids["pad"] if ids["pad"] is not None else self.eos_id
        for name in ("bos", "eos", "pad"):
            if ids[name] is not None and not 0 <= ids[name] < self.vocab_size:
                raise ValueError(f"{folder!r}: {name} token id {ids[name]} is outside the tokenizer's "
                                 f"{self.vocab_size} ids")
        # the variables a chat template uses, as transformers passes them
        self.special_tokens = {f"{name}_token": self._tok.id_to_token(ids[name])
                               for name in ("bos", "eos", "pad") if ids[name] is not None}

    @property
    def fingerprint(self) -> str:
        """The content of tokenizer.json and the special ids (which tokenizer_config.json/config.json pick)."""
        if self._fingerprint is None:
            self._fingerprint = f"hf-{file_digest(self.file)}-{self.bos_id}-{self.eos_id}-{self.pad_id}"
        return self._fingerprint

    def _check_added_tokens(self, tok_config: dict) -> None:
        """tokenizer_config.json's ``added_tokens_decoder`` (id -> token) must agree with tokenizer.json:
        transformers builds its tokenizer from both, so ids that differ are a tokenizer of another model."""
        decoder = tok_config.get("added_tokens_decoder") or {}
        for key, entry in (decoder.items() if isinstance(decoder, dict) else ()):
            text = _token_text(entry)
            there = self._tok.id_to_token(int(key)) if str(key).isdigit() else None
            if text is not None and there != text:
                has = f"{there!r} at id {key}" if there is not None else f"no id {key} (of {self.vocab_size})"
                raise ValueError(f"{self._tok_config_path}: added_tokens_decoder[{key!r}] is {text!r} but {self.file} "
                                 f"has {has}: the two files are of different tokenizers; copy both from one model")

    def _special(self, tok_config: dict, model_config: dict, name: str) -> int | None:
        text = _token_text(tok_config.get(f"{name}_token"))
        if text is not None:
            token_id = self._tok.token_to_id(text)
            if token_id is None:  # transformers would add it as a new token: ids this model never saw
                raise ValueError(f"{self._tok_config_path}: {name}_token {text!r} is not a token of {self.file}: the "
                                 f"two files are of different tokenizers; copy both from one model (or fix {name}_token)")
            return token_id
        value = model_config.get(f"{name}_token_id")
        if isinstance(value, list):  # e.g. Llama-3.1-Instruct: several EOS ids, the first is the document end
            value = value[0] if value else None
        return value

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
