"""Print one training sample as the model sees it, with the tokens that carry loss marked.

    python scripts/show_sample.py --config train_configs/X.toml [--index N] [--validation] [--section.key value ...]

The sample is the run's global sample ``N`` (the N-th the loader reads, after shuffling and
packing), built from the same settings as training: tokenizer (Hugging Face included), chat
template, packing, ``include_prompt_loss``, truncation. Tokens that are targets of the loss
are shown inside ⟦ ⟧ (or in green with ``--color``); special tokens by name (``<eos>``);
packed documents are separated by a rule; padding is counted, not printed. Use it to check a
chat template before spending GPU time: only the assistant's turns should be marked.
"""

from __future__ import annotations

import argparse
import sys

OPEN, CLOSE = "\u27e6", "\u27e7"
GREEN, RESET = "\033[32m", "\033[0m"


def token_text(tokenizer, ids: list[int]) -> str:
    """``ids`` decoded, special tokens kept (HF) or named (byte / tiktoken BOS, EOS, PAD)."""
    names = {tokenizer.bos_id: "<bos>", tokenizer.eos_id: "<eos>", tokenizer.pad_id: "<pad>"}
    inner = getattr(tokenizer, "_tok", None)  # a tokenizers.Tokenizer: keep the template's special tokens
    out, run = [], []

    def flush():
        if run:
            out.append(inner.decode(run, skip_special_tokens=False) if inner is not None else tokenizer.decode(run))
            run.clear()

    for i in ids:
        if i in names and names.get(i) and inner is None:
            flush()
            out.append(names[i])
        else:
            run.append(i)
    flush()
    return "".join(out)


def render(sample: dict, tokenizer, color: bool = False, ignore_index: int = -100) -> tuple[str, dict]:
    """The sample's text with loss spans marked, and counts (tokens, documents, loss tokens, padding)."""
    inputs = sample["input"].tolist()
    labels = sample["labels"].tolist()
    docs = sample["document_ids"].tolist()
    # the tokens the model reads, plus the last target; token j carries loss when labels[j - 1] does
    tokens = inputs + [labels[-1] if labels[-1] != ignore_index else None]
    carries = [False] + [lab != ignore_index for lab in labels]
    doc_of = docs + [docs[-1]]
    start, end = (GREEN, RESET) if color else (OPEN, CLOSE)
    lines, pieces, span, span_loss, current = [], [], [], None, None

    def close_span():
        if span:
            text = token_text(tokenizer, span)
            pieces.append(f"{start}{text}{end}" if span_loss else text)
            span.clear()

    n_docs = 0
    for tok, loss, doc in zip(tokens, carries, doc_of):
        if tok is None:
            break
        if doc != current:
            close_span()
            if pieces:
                lines.append("".join(pieces))
                pieces = []
            current = doc
            if doc >= 0:
                n_docs += 1
                lines.append(f"---- document {doc} ----")
        if doc < 0:
            continue  # padding: counted below
        if loss != span_loss:
            close_span()
            span_loss = loss
        span.append(tok)
    close_span()
    if pieces:
        lines.append("".join(pieces))
    counts = {"tokens": len(inputs), "documents": n_docs, "loss_tokens": sum(lab != ignore_index for lab in labels),
              "padding": sum(d < 0 for d in docs)}
    if counts["padding"]:
        lines.append(f"[{counts['padding']} padding tokens]")
    return "\n".join(lines), counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--index", type=int, default=0, help="global sample index (default 0: the first the run reads)")
    p.add_argument("--validation", action="store_true", help="a sample of the validation set instead")
    p.add_argument("--color", action="store_true", help="loss tokens in green instead of inside brackets")
    a, overrides = p.parse_known_args(argv)

    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.data.build import VALIDATION_SEED_OFFSET, build_dataset
    from titan_ulysses.interop.hub import resolve_hf_assets
    from titan_ulysses.interop.hf_datasets import training_dataset_path
    from titan_ulysses.data.sources import DataError
    from titan_ulysses.data.tokenizer import resolve_tokenizer
    from titan_ulysses.ops.loss import IGNORE_INDEX

    try:
        config = load_config(["--config", a.config, *overrides])
        resolve_hf_assets(config)  # a Hub id -> its snapshot folder (the tokenizer's)
        t, v, m = config.training, config.validation, config.model
        tokenizer = resolve_tokenizer(m)
        kind, path, seed = t.dataset, training_dataset_path(t), t.seed
        if a.validation:
            kind, path, seed = v.dataset or t.dataset, v.dataset_path, t.seed + VALIDATION_SEED_OFFSET
        dataset = build_dataset(kind, path, tokenizer, config, seed)
    except (ConfigError, DataError, OSError, ValueError) as e:
        raise SystemExit(f"show_sample: {e}") from e
    if not 0 <= a.index < len(dataset):
        raise SystemExit(f"show_sample: --index {a.index} is outside the {len(dataset)} samples of one epoch "
                         f"(0 to {len(dataset) - 1})")
    text, counts = render(dataset[a.index], tokenizer, a.color, IGNORE_INDEX)
    where = f"{kind} {path}" if path else kind
    print(f"sample {a.index} of {len(dataset)} ({where}, seq_len {t.seq_len}, packing {'on' if t.packing else 'off'}): "
          f"{counts['tokens']} tokens, {counts['documents']} document(s), {counts['loss_tokens']} carry loss, "
          f"{counts['padding']} padding")
    print(f"loss tokens are {'green' if a.color else 'inside ' + OPEN + ' ' + CLOSE}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
