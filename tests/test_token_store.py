"""The token store: built once, identical whatever the number of builders, invalidated by a
changed file, never half-used after a killed build; windows in a seeded order that resumes
exactly at any layout; bad input stopped with one line."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import validate
from titan_ulysses.data import sources
from titan_ulysses.data.build import build_dataset, data_settings, open_store
from titan_ulysses.data.loader import build_dataloader
from titan_ulysses.data.sources import DataError
from titan_ulysses.data.tokenizer import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(folder, n_docs=40, seed=0):
    rng = np.random.default_rng(seed)
    with open(os.path.join(folder, "a.jsonl"), "w") as f:
        for i in range(n_docs):
            f.write(json.dumps({"text": f"doc {i} " + "xyz" * int(rng.integers(1, 30))}) + "\n")
    with open(os.path.join(folder, "b.txt"), "w") as f:
        f.write("a whole file is one document")


def config_for(path, *args, dataset="text", seq_len=32):
    return load_config(["--training.dataset", dataset, "--training.dataset_path", str(path),
                        "--training.seq_len", str(seq_len), *args])


def store_arrays(store):
    return np.asarray(store.tokens).copy(), np.asarray(store.offsets).copy()


def _build_in_ranks(folder, cache, out):
    from titan_ulysses.data.build import node_group

    sources.JSONL_CHUNK_BYTES = 200  # many work items, split over the ranks
    group, rank, world = node_group()
    assert world == dist.get_world_size()
    store = open_store("text", folder, ByteTokenizer(), config_for(folder, "--training.dataset_cache_dir", cache),
                       group, rank, world)
    if dist.get_rank() == 0:
        tokens, offsets = store_arrays(store)
        np.savez(out, tokens=tokens, offsets=offsets, folder=store.folder)


def test_two_ranks_build_the_store_one_rank_builds(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(str(corpus))
    run_distributed(_build_in_ranks, 2, str(corpus), str(tmp_path / "cache2"), str(tmp_path / "two.npz"))
    monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 10**6)  # one item for the whole file
    one = open_store("text", str(corpus), ByteTokenizer(), config_for(corpus, "--training.dataset_cache_dir", str(tmp_path / "cache1")))
    two = np.load(tmp_path / "two.npz")
    tokens, offsets = store_arrays(one)
    assert np.array_equal(two["tokens"], tokens) and np.array_equal(two["offsets"], offsets)
    assert one.n_docs == 41 and tokens.dtype == np.uint16
    tok = ByteTokenizer()
    assert tok.decode(tokens[offsets[40]:offsets[41]]) == "a whole file is one document"
    assert not [d for d in os.listdir(tmp_path / "cache2") if ".parts" in d or ".tmp" in d]  # cleaned up


def test_store_is_reused_and_a_changed_file_invalidates_it(tmp_path):
    write_corpus(str(tmp_path))
    first = open_store("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path))
    again = open_store("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path))
    assert again.folder == first.folder
    with open(tmp_path / "b.txt", "w") as f:
        f.write("changed")
    changed = open_store("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path))
    assert changed.folder != first.folder
    assert ByteTokenizer().decode(np.asarray(changed.tokens[changed.offsets[-2]:])) == "changed"


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from titan_ulysses.data import sources, encode
from titan_ulysses.data.build import open_store
from titan_ulysses.config.manager import load_config
from titan_ulysses.data.tokenizer import ByteTokenizer
sources.JSONL_CHUNK_BYTES = 200
rows = [0]
real = encode.TextEncoder.__call__
def dying(self, where, row):
    rows[0] += 1
    if rows[0] == 25:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-build: some parts written, no store
    return real(self, where, row)
encode.TextEncoder.__call__ = dying
open_store("text", {path!r}, ByteTokenizer(), load_config(["--training.dataset", "text", "--training.dataset_path", {path!r}]))
"""


@pytest.mark.slow
def test_a_killed_build_leaves_no_store_and_the_next_build_is_whole(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(str(corpus))
    proc = subprocess.run([sys.executable, "-c", KILLER.format(root=ROOT, path=str(corpus))], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    cache = corpus / ".titan_cache"
    leftovers = os.listdir(cache)
    assert any(".parts-" in d for d in leftovers)  # whole parts (and the key's lock file), no store
    assert all(".parts-" in d or d.endswith(".lock") for d in leftovers)
    assert not any(os.path.exists(cache / d / "meta.json") for d in leftovers)
    monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 200)  # the same cut: the killed build's parts are reused
    resumed = open_store("text", str(corpus), ByteTokenizer(), config_for(corpus))
    assert os.listdir(cache) == [os.path.basename(resumed.folder)]  # parts merged and removed, lock gone
    monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 10**6)
    fresh = open_store("text", str(corpus), ByteTokenizer(),
                       config_for(corpus, "--training.dataset_cache_dir", str(tmp_path / "fresh")))
    for a, b in zip(store_arrays(resumed), store_arrays(fresh)):
        assert np.array_equal(a, b)


def test_min_document_tokens_and_one_document_per_window(tmp_path):
    write_corpus(str(tmp_path))
    config = config_for(tmp_path, "--training.min_document_tokens", "40", "--training.packing", "false",
                        "--training.shuffle", "false")
    ds = build_dataset("text", str(tmp_path), ByteTokenizer(), config, 0)
    lengths = ds.store.lengths()
    assert len(ds) == int((lengths >= 40).sum()) == ds.stats["windows"] and ds.stats["skipped_short"] > 0
    assert not ds.packed
    for i in range(len(ds)):
        item = ds[i]
        n = int((item["document_ids"] == 0).sum())
        assert n == min(32, int(lengths[ds.docs[i]])) and n >= 32 or (item["labels"][n - 1] == -100)
        assert int(item["truncated"]) == int(lengths[ds.docs[i]] > 32)
    packed = build_dataset("text", str(tmp_path), ByteTokenizer(),
                           config_for(tmp_path, "--training.min_document_tokens", "40"), 0)
    assert len(packed) == int(lengths[lengths >= 40].sum()) // 32


def test_shuffle_is_a_permutation_per_epoch(tmp_path):
    write_corpus(str(tmp_path), n_docs=80)
    ds = build_dataset("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path), seed=3)
    n = len(ds)
    epoch0 = [ds.window_of(i) for i in range(n)]
    epoch1 = [ds.window_of(i) for i in range(n, 2 * n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != list(range(n)) and epoch0 != epoch1
    other_seed = build_dataset("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path), seed=4)
    assert [other_seed.window_of(i) for i in range(n)] != epoch0


def _consume(ds, dp, local, steps, global_batch=8, state=None):
    loaders = [build_dataloader(ds, global_batch_size=global_batch, local_batch_size=local, dp_rank=r, dp_size=dp)
               for r in range(dp)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        rows = [tuple(row.tolist()) for it in iters for _ in range(global_batch // (dp * local))
                for row in next(it)["input"]]
        out.append(sorted(rows))
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("dataset", ["text", "sft"])
def test_resume_at_another_layout_reads_the_same_samples(tmp_path, dataset):
    if dataset == "sft":
        write_sft(tmp_path / "d.jsonl", 60)
        config = config_for(tmp_path / "d.jsonl", dataset="sft", seq_len=64)
    else:
        write_corpus(str(tmp_path), n_docs=60)
        config = config_for(tmp_path)
    ds = build_dataset(dataset, config.training.dataset_path, ByteTokenizer(), config, 0)
    steps = 2 * len(ds) // 8 + 2  # past an epoch boundary
    reference, _ = _consume(ds, 1, 8, steps)
    _, state = _consume(ds, 2, 2, 3)
    assert _consume(ds, 4, 1, steps - 3, state=state)[0] == reference[3:]


def write_sft(path, n, seed=0, prompt_len=None):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = prompt_len or int(rng.integers(3, 30))
            prompt = "".join(rng.choice(list("abcdefghij"), k))
            f.write(json.dumps({"prompt": prompt, "completion": " ok!"}) + "\n")


def test_data_settings_changed_on_resume_are_named(tmp_path):
    write_corpus(str(tmp_path))
    config = config_for(tmp_path)
    ds = build_dataset("text", str(tmp_path), ByteTokenizer(), config, 0)
    saved = build_dataloader(ds, global_batch_size=2, local_batch_size=2, dp_rank=0, dp_size=1,
                             settings=data_settings(config))
    state = saved.state_dict()
    other = config_for(tmp_path, seq_len=64)
    for allow, raises in ((False, True), (True, False)):
        loader = build_dataloader(ds, global_batch_size=2, local_batch_size=2, dp_rank=0, dp_size=1,
                                  settings=data_settings(other), allow_change=allow)
        if raises:
            with pytest.raises(DataError, match=r"seq_len 32 -> 64.*checkpoint.allow_data_change"):
                loader.load_state_dict(state)
        else:
            loader.load_state_dict(state)


# -- bad input: one clear line ----------------------------------------------------------------

def test_missing_dataset_path_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="training.dataset 'text' needs training.dataset_path"):
        validate(load_config(["--training.dataset", "text"]), 1)
    with pytest.raises(DataError, match=r"training.dataset_path '.*nope.jsonl' does not exist"):
        build_dataset("text", str(tmp_path / "nope.jsonl"), ByteTokenizer(), config_for(tmp_path / "nope.jsonl"), 0)


@pytest.mark.parametrize("content, dataset, message", [
    (b"", "text", "holds no documents"),
    (b'{"text": "fine"}\n{"txt": "typo"}\n', "text", r"bad.jsonl line 2: field 'text' is missing"),
    # present but null: not "missing" beside a list of the fields found that names it
    (b'{"text": "fine"}\n{"text": null}\n', "text", r"bad.jsonl line 2: field 'text' is null; every row needs a "
                                                   r"string 'text' \(fields found: \['text'\]\)$"),
    (b'{"text": ["a"]}\n', "text", r"bad.jsonl line 1: field 'text' is a list; "),
    (b'{"prompt": null, "completion": "c"}\n', "sft", r"bad.jsonl line 1: field 'prompt' is null; a string"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', "text", r"bad.jsonl line 2: not UTF-8"),
    (b'{"prompt": "p", "completion": "c"}\n{"prompt": "p"}\n', "sft", r"bad.jsonl line 2: field 'completion' is missing"),
    (b'{"prompt": "p", "completion": "' + b"c" * 100 + b'"}\n', "sft", "longer than training.seq_len 32.*'truncate' or 'drop'"),
])
def test_bad_data_is_one_clear_line(tmp_path, content, dataset, message):
    (tmp_path / "bad.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=message):
        build_dataset(dataset, str(tmp_path / "bad.jsonl"), ByteTokenizer(), config_for(tmp_path / "bad.jsonl", dataset=dataset), 0)


@pytest.mark.slow
def test_train_py_exits_2_with_one_line_on_bad_data(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"txt": "typo"}\n')
    proc = subprocess.run([sys.executable, "train.py", "--training.dataset", "text", "--training.dataset_path",
                           str(tmp_path / "bad.jsonl"), "--job.dump_folder", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "MASTER_PORT": "29517"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"data error: {tmp_path / 'bad.jsonl'} line 1: field 'text' is missing; every row needs "
                      f"a string 'text' (fields found: ['txt'])"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_non_utf8_text_file_is_named(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text \(byte 3\)"):
        build_dataset("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path), 0)


def _old_checkpoint_loads(folder, corpus):
    from model_harness import build_pair, small_args
    from titan_ulysses.checkpoint.manager import CheckpointManager
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.llama.parallelize import ParallelizeOptions

    pd = ParallelDims(world_size=1)
    pd.build_mesh("cpu")
    _, model = build_pair(small_args(), pd, ParallelizeOptions(param_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    config = config_for(corpus)
    ds = build_dataset("text", corpus, ByteTokenizer(), config, 0)

    def manager(settings):
        loader = build_dataloader(ds, global_batch_size=2, local_batch_size=2, dp_rank=0, dp_size=1, settings=settings)
        return loader, CheckpointManager(folder=folder, model=model, optimizer=opt, lr_scheduler=sched,
                                         dataloader=loader, enable=True, interval=1)

    old_loader, old = manager(None)  # as written before the data settings were recorded
    next(iter(old_loader))
    old.save(1)
    new_loader, new = manager(data_settings(config))
    assert new.load() == 1 and new_loader.state_dict()["dataset_state"]["samples_consumed"] == 2
    new.save(2, force=True)
    other_loader, other = manager(data_settings(config_for(corpus, seq_len=64)))
    with pytest.raises(DataError, match="seq_len 32 -> 64"):
        other.load()


def test_a_checkpoint_without_data_settings_still_loads_and_a_new_one_is_checked(tmp_path):
    write_corpus(str(tmp_path))
    build_dataset("text", str(tmp_path), ByteTokenizer(), config_for(tmp_path), 0)  # store built once
    run_distributed(_old_checkpoint_loads, 1, str(tmp_path / "ckpt"), str(tmp_path))
