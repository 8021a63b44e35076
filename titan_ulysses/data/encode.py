"""Rows -> token ids (and, for SFT, which tokens carry loss), as the token store stores them.

Pretraining text: ``{"text": ...}`` rows (jsonl, parquet) or whole ``.txt`` files, each
encoded with BOS and EOS; a long one in bounded pieces with the same ids (``long_documents.py``).

SFT, one sample per row, as TRL's SFTTrainer reads them:

* ``{"prompt": str, "completion": str}``: BOS + prompt + completion + EOS, each part
  tokenized on its own; the completion and the EOS carry loss.
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the chat template
  (``chat.py``); the assistant turns carry loss.
* ``{"prompt": [messages], "completion": [messages]}`` (conversational prompt/completion):
  rendered as one conversation; the completion's assistant turns carry loss.
"""

from __future__ import annotations

import numpy as np

from titan_ulysses.data.chat import ChatTemplate, assistant_spans
from titan_ulysses.data.long_documents import encode_document
from titan_ulysses.data.sources import DataError, kind_of, text_field


class TextEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, where, row):
        return encode_document(self.tokenizer, text_field(where, row), where), None


def _text_parts(content) -> bool:
    """``content`` as transformers' templates also take it: a list of ``{"type": "text", "text": str}`` parts."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)


def _check_messages(where, messages, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                isinstance(content, str) or _text_parts(content)):
            raise DataError(f"{where}: field {field!r} message {i} needs string 'role' and 'content' (a string or "
                            f"a list of {{\"type\": \"text\", \"text\": ...}} parts; other parts are not supported)")


class SFTEncoder:
    def __init__(self, tokenizer, template: ChatTemplate):
        self.tokenizer, self.template = tokenizer, template

    def _encode(self, text: str, where) -> list[int]:
        ids = encode_document(self.tokenizer, text, where, False, False)
        return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)

    def __call__(self, where, row):
        if isinstance(row, str):
            raise DataError(f"{where}: SFT needs .jsonl or .parquet rows with 'prompt'/'completion' or 'messages', "
                            f"not a .txt file")
        if "messages" in row:
            _check_messages(where, row["messages"], "messages")
            return self._chat(where, row["messages"], 0)
        if "prompt" not in row or "completion" not in row:
            missing = "completion" if "prompt" in row else "prompt"
            hint = ("; a 'text' row is pretraining text: set the dataset of this file (training. or "
                    "validation.dataset) to 'text'") if "text" in row and "prompt" not in row else ""
            raise DataError(f"{where}: field {missing!r} is missing; an SFT row needs 'prompt' and 'completion', "
                            f"or 'messages' (fields found: {sorted(row)}){hint}")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            _check_messages(where, prompt, "prompt")
            _check_messages(where, completion, "completion")
            return self._chat(where, prompt + completion, len(prompt))
        for field, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise DataError(f"{where}: field {field!r} is {kind_of(value)}; "
                                f"a string (or, for both fields, a list of messages) is expected")
        tok = self.tokenizer
        p = ([tok.bos_id] if tok.bos_id is not None else []) + self._encode(prompt, where)  # Qwen has no BOS
        c = self._encode(completion, where) + [tok.eos_id]
        return p + c, [0] * len(p) + [1] * len(c)

    def _chat(self, where, messages, first: int):
        text, spans = assistant_spans(self.template, messages, first, where)
        if not spans:
            raise DataError(f"{where}: no assistant turn to learn from (roles: {[m['role'] for m in messages]})")
        ids, mask, cursor = [], [], 0
        for start, end in spans:
            for piece, flag in ((text[cursor:start], 0), (text[start:end], 1)):
                if piece:
                    out = self._encode(piece, where)
                    ids += out
                    mask += [flag] * len(out)
            cursor = end
        if cursor < len(text):
            out = self._encode(text[cursor:], where)
            ids += out
            mask += [0] * len(out)
        return np.asarray(ids), np.asarray(mask, dtype=np.uint8)
