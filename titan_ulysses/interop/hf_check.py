"""What a Hugging Face folder's safetensors must be before a run loads them (issues 20 and 33).

Read from the headers alone (no weight is read, except the two tensors of a tied head
below), before any process group; each refusal is one line naming the tensor and its file:

* ``model.safetensors.index.json``: readable, and every file it names is in the folder (other
  files beside them, such as Mistral's ``consolidated.safetensors``, are not the model's, as for
  transformers, unless they hold one of its names); no tensor name in two files;
* every tensor config.json implies is there, with its shape; none of layers past
  ``num_hidden_layers``;
* every tensor the model loads is a float of F32, BF16 or F16: an integer, float8 or otherwise
  quantized tensor would be cast to float and trained as if it were the weights;
* no tensor in the files goes unused: the loader reads only the tensors it maps, so any other
  one would be dropped without a word. The exceptions are explicit (``IGNORED``, what transformers
  itself drops), and an ``lm_head.weight`` beside ``tie_word_embeddings: true`` is accepted only
  when it equals ``model.embed_tokens.weight`` (transformers then ties them; when they differ it
  keeps both, which a tied model cannot).
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass

import torch

from titan_ulysses.interop.hf_adapter import expected_hf_shapes
from titan_ulysses.models.decoder.args import DecoderArgs

INDEX = "model.safetensors.index.json"
# tensors that Hugging Face files may hold and a model does not use; transformers drops them on load
IGNORED = {
    # RoPE frequencies that older transformers versions saved per layer; recomputed from config.json
    # (transformers' _adjust_missing_and_unexpected_keys ignores ``rotary_emb.inv_freq``)
    r"(^|\.)rotary_emb\.inv_freq$": "RoPE frequencies, recomputed from config.json",
}
FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # what the loader may read
_TIED = ("lm_head.weight", "model.embed_tokens.weight")
_ROWS = 4096  # rows per block when comparing a tied head with the embedding


@dataclass(frozen=True)
class Stored:
    """One tensor of the folder, from its file's header."""
    shape: tuple[int, ...]
    dtype: str  # the safetensors spelling: F32, BF16, I8, F8_E4M3, ...
    file: str


def _index_files(folder: str) -> set[str] | None:
    """The files ``model.safetensors.index.json`` names (each checked to be there); None without an index."""
    path = os.path.join(folder, INDEX)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = {name: file for name, file in json.load(f)["weight_map"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a readable index ({type(e).__name__}: {e}); download it again") from e
    for file in sorted(set(files.values())):
        if not os.path.isfile(os.path.join(folder, file)):
            count = sum(1 for f in files.values() if f == file)
            example = next(name for name, f in files.items() if f == file)
            raise ValueError(f"{path} names {file} (for {count} tensor(s), e.g. {example!r}), which is not in "
                             f"{folder}; download that file again (an interrupted download?)")
    return set(files.values())


def _read(file: str) -> dict[str, Stored]:
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return {key: Stored(tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype(), file)
                    for key in f.keys()}
    except Exception as e:  # SafetensorError (a truncated or garbled file) subclasses Exception only
        raise ValueError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}; truncated "
                         f"by an interrupted copy?); download or copy it again") from e


def read_headers(folder: str) -> dict[str, Stored]:
    """Name -> shape, dtype and file of every tensor of the model's ``*.safetensors`` (headers only).

    With an index, the model is the files it names, as for transformers; another file beside them
    (Mistral's ``consolidated.safetensors``, in its own names) is not part of it, but the loader
    reads every file's header, so one that holds a name of the model's is refused.
    """
    listed = _index_files(folder)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{folder!r} has no *.safetensors weights")
    found: dict[str, Stored] = {}
    outside = []
    for file in files:
        if listed is not None and os.path.basename(file) not in listed:
            outside.append(file)
            continue
        for key, stored in _read(file).items():
            if key in found:
                raise ValueError(f"{file} and {found[key].file} both hold {key!r}; remove the stale file")
            found[key] = stored
    for file in outside:
        clash = sorted(set(_read(file)) & set(found))
        if clash:
            raise ValueError(f"{file}, which {INDEX} does not name, holds {clash[0]!r} too (the loader reads every "
                             f"*.safetensors file of the folder): move it out of {folder}")
    return found


def _extra_layers(found: dict, n_layers: int) -> list[str]:
    """Tensors of layers past ``n_layers`` (config.json says fewer layers than the weights hold)."""
    return sorted(k for k in found if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= n_layers)


def _equal(a: Stored, b: Stored) -> bool:
    """Whether the tied head and the embedding hold the same values (compared in blocks of rows)."""
    from safetensors import safe_open

    if a.shape != b.shape:
        return False
    with safe_open(a.file, framework="pt") as fa, safe_open(b.file, framework="pt") as fb:
        sa, sb = fa.get_slice(_TIED[0]), fb.get_slice(_TIED[1])
        for start in range(0, a.shape[0], _ROWS):
            if not torch.equal(sa[start:start + _ROWS].float(), sb[start:start + _ROWS].float()):
                return False
    return True


def _check_unused(found: dict[str, Stored], expected: dict, args: DecoderArgs) -> None:
    unused = sorted(k for k in set(found) - set(expected) if not any(re.search(p, k) for p in IGNORED))
    head, embed = _TIED
    if head in unused and args.tie_embeddings and embed in found:
        if not _equal(found[head], found[embed]):
            raise ValueError(
                f"config.json says tie_word_embeddings true, but {found[head].file} holds {head!r} and it differs "
                f"from {embed!r} ({found[embed].file}): a tied model would drop the head; set tie_word_embeddings "
                f"false in config.json if the head is trained apart (transformers then keeps both)")
        unused.remove(head)  # the same values: tying them drops nothing
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ValueError(f"{found[unused[0]].file} holds {unused[0]!r}{more}, which the model of config.json does "
                         f"not use, so the load would drop it: config.json does not describe these weights (or they "
                         f"are another model's); fix config.json or remove the tensor")


def _check_dtypes(found: dict[str, Stored], expected: dict) -> None:
    for name in sorted(expected):
        stored = found[name]
        if stored.dtype not in FLOATS:
            kind = "an integer" if stored.dtype[0] in "IU" else "a quantized" if stored.dtype.startswith("F8") \
                else "an unexpected"
            raise ValueError(f"{stored.file}: {name!r} is {stored.dtype}, {kind} dtype the loader would cast to "
                             f"float and train as weights; the model reads {', '.join(FLOATS)} only: use the "
                             f"unquantized weights")


def check_hf_weights(folder: str, args: DecoderArgs) -> None:
    """Refuse (ValueError, one line) weights that are missing, shaped unlike ``args`` (from config.json),
    of a dtype the model does not read, or that the model would drop."""
    found = read_headers(folder)
    expected = expected_hf_shapes(args)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"{len(missing)} tensor(s) that config.json implies are not in the safetensors files, "
                         f"e.g. {missing[0]!r}")
    extra = _extra_layers(found, args.n_layers)
    if extra:
        raise ValueError(f"the safetensors files hold {len(extra)} tensor(s) of layers past config.json's "
                         f"num_hidden_layers {args.n_layers}, e.g. {extra[0]!r}: config.json does not describe "
                         f"these weights; fix num_hidden_layers")
    for name, shape in expected.items():
        if found[name].shape != shape:
            raise ValueError(f"{name!r} has shape {list(found[name].shape)} in the safetensors files but "
                             f"{list(shape)} by config.json")
    _check_dtypes(found, expected)
    _check_unused(found, expected, args)


def weights_dtype(folder: str) -> str | None:
    """The dtype the folder's float weights are stored in (the widest, when mixed), e.g. ``"float32"``;
    None when the folder has no safetensors, or one that cannot be read (a checkpoint's commit records
    this, and must not fail on a folder the run only took its architecture from)."""
    try:
        stored = read_headers(folder).values() if glob.glob(os.path.join(folder, "*.safetensors")) else ()
    except (OSError, ValueError):
        return None
    dtypes = {FLOATS[s.dtype] for s in stored if s.dtype in FLOATS}
    return str(max(dtypes, key=lambda d: d.itemsize)).removeprefix("torch.") if dtypes else None
