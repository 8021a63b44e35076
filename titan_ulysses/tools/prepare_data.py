"""Tokenize a corpus into the token store ahead of training, with worker processes.

    python scripts/prepare_data.py --config train_configs/X.toml [--section.key value ...] [--workers N]

Reads the same settings as training (``training.dataset``, ``dataset_path``,
``dataset_cache_dir``, ``model.tokenizer`` / ``tokenizer_path`` / ``hf_assets_path``, ``training.chat_template``;
with ``validation.enable`` also the held-out set) and builds exactly the store a run with
those settings would build, so the run then starts at once. Prints the throughput.
A store that already exists is reported, not rebuilt.
"""

from __future__ import annotations

import os
import sys
import time

from titan_ulysses.interop.hub import resolve_hf_assets
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.data.build import open_store
from titan_ulysses.interop.hf_datasets import is_hf, training_dataset_path
from titan_ulysses.data.sources import DataError, list_files
from titan_ulysses.data.tokenizer import resolve_tokenizer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: titan-prepare-data (or python scripts/prepare_data.py) --config X [--section.key value ...] "
              f"[--workers N]\n\n{__doc__}", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    workers = os.cpu_count() or 1
    if "--workers" in argv:
        i = argv.index("--workers")
        workers = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    try:
        config = load_config(argv)
        resolve_hf_assets(config)  # a Hub id -> its snapshot folder (the tokenizer's)
        tokenizer = resolve_tokenizer(config.model)
        t, v = config.training, config.validation
        jobs = [(t.dataset, training_dataset_path(t))]
        if v.enable and (v.dataset or t.dataset) != "passkey":
            jobs.append((v.dataset or t.dataset, v.dataset_path))
        for kind, path in jobs:
            if kind == "passkey":
                print("training.dataset 'passkey' is synthetic: nothing to prepare")
                continue
            size = 0 if is_hf(path) else sum(os.path.getsize(f) for f in list_files(path))
            start = time.perf_counter()
            store = open_store(kind, path, tokenizer, config, processes=workers)
            took = time.perf_counter() - start
            print(f"{path}: {size / 2**20:,.0f} MB -> {store.n_docs:,} documents, {store.n_tokens:,} tokens "
                  f"({store.tokens.dtype}) in {took:.1f}s with {workers} worker(s): {size / 2**20 / took:,.1f} MB/s, "
                  f"{store.n_tokens / took / 1e6:,.2f} M tokens/s; store {store.folder}", flush=True)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
