"""A long document is tokenized in bounded pieces with exactly the ids of one call on the whole text.

Equality is checked with pieces of a few characters (so a cut lands everywhere a cut may land) on
adversarial and random texts, for every tokenizer kind whose cut rule is proven; memory is
bounded by the longest text the tokenizer is handed, not by a timing.
"""

import base64
import json
import random
import tracemalloc

import numpy as np
import pytest

from hf_fixtures import TEXTS, make_tokenizer
from titan_ulysses.data import long_documents
from titan_ulysses.data.encode import TextEncoder
from titan_ulysses.interop.hf_tokenizer import HFTokenizer
from titan_ulysses.data.long_documents import encode_document, hf_cut_rule
from titan_ulysses.data.sources import DataError
from titan_ulysses.data.tokenizer import ByteTokenizer, TiktokenTokenizer

LLAMA3 = long_documents.KNOWN_PATTERNS[0]
QWEN2 = long_documents.KNOWN_PATTERNS[1]
TRICKY = ["a", "b", "Z", "s", "t", " ", " ", "  ", "\n", "\n\n", "\r\n", "\t", "'", "'s", "'ll", "1", "22", "333",
          ".", "!", ",", "é", "e\u0301", "\u0301", "東京", "🙂", "ß", "-", "<|end_of_text|>", "<mask>", "hello world",
          " hello", "x ", "Q"]
ADVERSARIAL = [
    "It's a test.  Two  spaces\nand\n\nnewlines it'll  handle 12345 numbers, naïve e\u0301 café 東京 🙂 ok",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 5,
    "word<|end_of_text|>word <|end_of_text|> word<mask> x <mask>y hello world hello  world",
    "no spaces at all: " + "東" * 80 + " then a few words here and there",
]


def _tiktoken(tmp_path):
    ranks = [bytes([b]) for b in range(256)]
    for text in TEXTS:  # a few merges, including ones that start with a space
        for word in text.split():
            for piece in (word.encode(), b" " + word.encode()):
                if 1 < len(piece) <= 6 and piece not in ranks:
                    ranks.append(piece)
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return TiktokenTokenizer(str(path))


def _hf(tmp_path, name, pre=None, normalizer=None, added=()):
    """A byte-level BPE trained on the fixture texts, with another pre-tokenizer / normalizer / added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

    folder = tmp_path / name
    make_tokenizer(str(folder))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if pre == "llama3" or pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3 if pre == "llama3" else QWEN2), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "none":
        tok.pre_tokenizer = None
    if normalizer == "nfc":
        tok.normalizer = normalizers.NFC()
    elif normalizer == "sentencepiece":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    for content, special, lstrip, rstrip in added:
        token = AddedToken(content, lstrip=lstrip, rstrip=rstrip, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    tok.save(str(folder / "tokenizer.json"))
    return HFTokenizer(str(folder))


ADDED = [("<mask>", True, True, True), ("hello world", False, False, False), ("x ", False, False, True)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    out = {"byte": ByteTokenizer(), "tiktoken": _tiktoken(tmp), "hf-bytelevel": _hf(tmp, "bl", added=ADDED),
           "hf-llama3": _hf(tmp, "l3", pre="llama3", added=ADDED),
           "hf-qwen2-nfc": _hf(tmp, "q2", pre="qwen2", normalizer="nfc", added=ADDED)}
    assert {t.cut_rule for t in out.values()} == {"any", "space"}
    return out


@pytest.mark.parametrize("kind", ["byte", "tiktoken", "hf-bytelevel", "hf-llama3", "hf-qwen2-nfc"])
def test_pieces_give_the_ids_of_the_whole_text(tokenizers, kind, monkeypatch):
    tok = tokenizers[kind]
    rng = random.Random(kind)
    texts = ADVERSARIAL + ["".join(rng.choice(TRICKY) for _ in range(rng.randrange(50, 400))) for _ in range(150)]
    for piece in (7, 16, 64):
        monkeypatch.setattr(long_documents, "PIECE_CHARS", piece)
        for text in texts:
            for bos, eos in ((True, True), (False, False)):
                ours = encode_document(tok, text, "row", bos, eos)
                assert list(ours) == list(tok.encode(text, bos, eos)), (kind, piece, text)


def test_the_rule_is_given_only_where_it_is_proven(tokenizers, tmp_path):
    assert tokenizers["hf-bytelevel"].cut_rule == "space" and tokenizers["hf-llama3"].cut_rule == "space"
    assert _hf(tmp_path, "sp", pre="none", normalizer="sentencepiece").cut_rule is None
    spec = json.loads(open(tokenizers["hf-llama3"].file).read())
    assert hf_cut_rule(spec) == "space"
    assert hf_cut_rule({**spec, "normalizer": {"type": "NFKC"}}) is None
    other = json.loads(json.dumps(spec))
    other["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\S+|\s+"
    assert hf_cut_rule(other) is None
    assert hf_cut_rule({**spec, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}}) is None


def test_a_long_document_reaches_the_tokenizer_in_bounded_pieces(tokenizers, monkeypatch):
    """The memory bound is the piece: the tokenizer (about 240 bytes per character at once) never holds more."""
    tok = tokenizers["hf-llama3"]
    text = " ".join(TEXTS) * 800  # about 640K characters, one row
    assert len(text) > 2 * long_documents.PIECE_CHARS
    seen = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda t, bos=True, eos=True: seen.append(len(t)) or real(t, bos, eos))
    ids, _ = TextEncoder(tok)("big.jsonl line 1", {"text": text})
    assert max(seen) <= long_documents.PIECE_CHARS and len(seen) >= 3
    monkeypatch.undo()
    assert np.array_equal(ids, tok.encode(text))


def test_the_byte_tokenizer_holds_ids_compactly():
    """Python-side memory (tracemalloc) of one 4 MiB document: int32 ids, not a list of 8-byte pointers."""
    text = "x" * (4 << 20)
    tracemalloc.start()
    ids, _ = TextEncoder(ByteTokenizer())("row", {"text": text})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ids) == len(text) + 2
    assert peak < 10 * len(text), f"{peak / len(text):.1f} bytes per character"


def test_a_document_that_cannot_be_cut_is_refused_above_the_stated_size(tokenizers, tmp_path, monkeypatch):
    monkeypatch.setattr(long_documents, "PIECE_CHARS", 100)
    monkeypatch.setattr(long_documents, "MAX_WHOLE_CHARS", 1000)
    spm = _hf(tmp_path, "sp", pre="none", normalizer="sentencepiece")
    text = "word " * 150  # 750 characters: whole, as before
    assert list(encode_document(spm, text, "row")) == spm.encode(text)
    with pytest.raises(DataError) as e:
        encode_document(spm, "word " * 300, "big.jsonl line 3")
    line = str(e.value)
    assert line.startswith("big.jsonl line 3: a document of 1,500 characters, and this tokenizer's pre-tokenizer "
                           "gives no place where a cut keeps the same token ids within 1,000 characters") and "\n" not in line
    assert line.endswith("split it into rows of at most 1,000 characters")
    with pytest.raises(DataError, match="^row: a document of 1,200 characters, and no ASCII letter before a space"):
        encode_document(tokenizers["hf-llama3"], "東" * 1200, "row")
    assert list(encode_document(tokenizers["hf-llama3"], "東" * 900, "row")) == tokenizers["hf-llama3"].encode("東" * 900)
