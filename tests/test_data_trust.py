"""Issue 20, data side: one tokenizer resolution, a token store keyed on content and safe for
concurrent and failing builders, the corpus fingerprint on resume, and one-line refusals of
bad tokenizer, template and corpus files."""

import errno
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hf_fixtures import make_tokenizer
from titan_ulysses.config.manager import load_config
from titan_ulysses.data import sources, token_store
from titan_ulysses.data.build import build_data, build_dataset, open_store
from titan_ulysses.data.build_lock import BuildLock
from titan_ulysses.data.sources import DataError
from titan_ulysses.data.tokenizer import ByteTokenizer, TokenizerError, resolve_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def write_text_corpus(folder, n_docs=60, start=0):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "a.jsonl"), "a") as f:
        for i in range(start, start + n_docs):
            f.write(json.dumps({"text": f"The pass key is {i}. Remember it. " * (1 + i % 3)}) + "\n")


def litter(cache):
    return sorted(d for d in os.listdir(cache) if ".parts-" in d or ".tmp-" in d)


def stores(cache):
    return sorted(d for d in os.listdir(cache) if os.path.isfile(os.path.join(cache, d, "meta.json")))


# --- bug 4: one tokenizer resolution; the cache keyed on the tokenizer's content -------------

def swap_two_token_ids(path):
    """The same tokenizer.json but for two ordinary tokens' ids: same vocabulary size and specials."""
    from tokenizers import Tokenizer

    a, b = Tokenizer.from_file(str(path)).encode("The pass key").tokens[:2]  # tokens the corpus uses
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(data))

def test_prepare_data_with_hf_assets_path_and_one_store_per_tokenizer_content(tmp_path, capsys):
    import prepare_data

    hf, corpus, cache = tmp_path / "hf", tmp_path / "corpus", tmp_path / "cache"
    make_tokenizer(str(hf))
    write_text_corpus(str(corpus))
    common = ["--training.dataset", "text", "--training.dataset_path", str(corpus),
              "--training.dataset_cache_dir", str(cache), "--model.tokenizer", "hf"]
    assert prepare_data.main([*common, "--model.hf_assets_path", str(hf), "--workers", "2"]) == 0
    assert "documents" in capsys.readouterr().out
    [first] = stores(cache)
    # the same file spelled as model.tokenizer_path: the same store, not a second one
    config = load_config([*common, "--model.tokenizer_path", str(hf / "tokenizer.json")])
    again = open_store("text", str(corpus), resolve_tokenizer(config.model), config)
    assert stores(cache) == [first] and os.path.basename(again.folder) == first
    # another tokenizer.json at the same path (same size of vocabulary, same mtime): a new store with other ids
    stat = os.stat(hf / "tokenizer.json")
    swap_two_token_ids(hf / "tokenizer.json")
    os.utime(hf / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = open_store("text", str(corpus), resolve_tokenizer(config.model), config)
    assert os.path.basename(changed.folder) != first and len(stores(cache)) == 2
    assert not np.array_equal(np.asarray(changed.tokens), np.asarray(again.tokens))
    assert not litter(cache)


def test_a_changed_chat_template_at_the_same_path_gives_a_new_store(tmp_path, capsys):
    corpus, template = tmp_path / "chat.jsonl", tmp_path / "t.jinja"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(8)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    template.write_text(body)
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(corpus),
                          "--training.chat_template", str(template)])
    first = open_store("sft", str(corpus), ByteTokenizer(), config)
    assert "tokenizing (1 worker(s)): 100%" in capsys.readouterr().err  # rank 0's progress bar
    template.write_text(body.replace("</s>", "</turn>"))
    second = open_store("sft", str(corpus), ByteTokenizer(), config)
    assert second.folder != first.folder
    assert "</turn>" in ByteTokenizer().decode(np.asarray(second.tokens[:second.offsets[1]]))


# --- bug 4 / refusals: tokenizer files --------------------------------------------------------

def _hf_config(folder):
    return load_config(["--model.tokenizer", "hf", "--model.hf_assets_path", str(folder)]).model


def test_bad_tokenizer_files_are_one_line_naming_the_setting(tmp_path):
    hf = tmp_path / "hf"
    make_tokenizer(str(hf))
    assert resolve_tokenizer(_hf_config(hf)).eos_id is not None
    text = (hf / "tokenizer.json").read_text()
    (hf / "tokenizer.json").write_text(text[: len(text) // 2])  # an interrupted copy
    with pytest.raises(TokenizerError, match=r"^model.hf_assets_path .*tokenizer.json is not a valid tokenizer.json"):
        resolve_tokenizer(_hf_config(hf))
    make_tokenizer(str(hf))
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": None}))
    with pytest.raises(TokenizerError, match=r"^model.hf_assets_path .*no EOS token"):
        resolve_tokenizer(_hf_config(hf))
    garbage = tmp_path / "tokenizer.model"
    garbage.write_bytes(os.urandom(3000))
    with pytest.raises(TokenizerError, match=r"^model.tokenizer_path .* is not a tiktoken BPE file"):
        resolve_tokenizer(load_config(["--model.tokenizer", "tiktoken", "--model.tokenizer_path", str(garbage)]).model)
    with pytest.raises(TokenizerError, match=r"^model.hf_assets_path .*no tokenizer.json"):
        resolve_tokenizer(_hf_config(tmp_path / "nowhere"))


def test_a_tokenizer_with_more_ids_than_the_model_is_refused():
    from titan_ulysses.config.manager import ConfigError
    from titan_ulysses.models.resolve import model_args

    config = load_config(["--model.flavor", "debugmodel"])
    with pytest.raises(ConfigError, match=r"the tokenizer has 100000 ids but model.flavor 'debugmodel' has "
                                          r"vocab_size \d+"):
        model_args(config, 100000)


# --- refusals: chat templates and SFT truncation -----------------------------------------------

MISTRAL_LIKE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                "{% endif %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}"
                "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_template_that_raises_names_the_template_and_the_row(tmp_path):
    corpus, template = tmp_path / "chat.jsonl", tmp_path / "mistral.jinja"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    bad = {"messages": [{"role": "system", "content": "be nice"}, *good["messages"]]}
    corpus.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    template.write_text(MISTRAL_LIKE)
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(corpus),
                          "--training.chat_template", str(template)])
    with pytest.raises(DataError, match=rf"chat.jsonl.* 2\b.*chat template \({template}\) failed on this row: "
                                        r"TemplateError: Conversation roles must alternate"):
        open_store("sft", str(corpus), ByteTokenizer(), config)
    assert not litter(tmp_path / ".titan_cache")


def test_a_jinja_template_gets_the_tokenizers_eos_token(tmp_path):
    hf, corpus, template = tmp_path / "hf", tmp_path / "chat.jsonl", tmp_path / "mistral.jinja"
    make_tokenizer(str(hf))
    corpus.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"}]}) + "\n")
    template.write_text(MISTRAL_LIKE)
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(corpus),
                          "--training.chat_template", str(template), "--model.tokenizer", "hf",
                          "--model.hf_assets_path", str(hf)])
    tokenizer = resolve_tokenizer(config.model)
    store = open_store("sft", str(corpus), tokenizer, config)
    ids = np.asarray(store.tokens).tolist()
    assert ids[-1] == tokenizer.eos_id  # '{{ eos_token }}' rendered as the tokenizer's EOS, as transformers does
    assert np.asarray(store.mask)[-1] == 1


def test_the_template_beside_hf_assets_path_is_used_not_chatml(tmp_path):
    """With only model.hf_assets_path set, chat_template.jinja in that folder is the template
    (it was looked up beside model.tokenizer_path only, and ChatML silently took its place)."""
    hf, corpus = tmp_path / "hf", tmp_path / "chat.jsonl"
    make_tokenizer(str(hf))
    (hf / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                            "{{ eos_token }}{% endfor %}")
    corpus.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "yo"}]}) + "\n")
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(corpus),
                          "--model.tokenizer", "hf", "--model.hf_assets_path", str(hf)])
    tokenizer = resolve_tokenizer(config.model)
    store = open_store("sft", str(corpus), tokenizer, config)
    text = tokenizer.decode(np.asarray(store.tokens).tolist())
    assert text.startswith("[user] hi") and "<|im_start|>" not in text


def test_truncation_that_leaves_no_loss_token_is_a_data_error(tmp_path):
    corpus = tmp_path / "d.jsonl"
    corpus.write_text(json.dumps({"prompt": "a long question " * 4, "completion": " ok"}) + "\n"
                      + json.dumps({"prompt": "short?", "completion": " ok"}) + "\n")
    config = load_config(["--training.dataset", "sft", "--training.dataset_path", str(corpus),
                          "--training.seq_len", "16", "--training.overlong_samples", "truncate"])
    with pytest.raises(DataError, match=r"1 SFT sample\(s\) of .* keep no completion token once truncated to "
                                        r"training.seq_len 16 \(first: sample #0"):
        build_dataset("sft", str(corpus), ByteTokenizer(), config, 0)
    # a completion that starts inside the window is fine
    build_dataset("sft", str(corpus), ByteTokenizer(), load_config(
        ["--training.dataset", "sft", "--training.dataset_path", str(corpus), "--training.seq_len", "67",
         "--training.overlong_samples", "truncate"]), 0)


# --- the token store: concurrent, failing and killed builders ----------------------------------

BUILDER = """
import os, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from titan_ulysses.data import sources, token_store
from titan_ulysses.data.encode import TextEncoder
from titan_ulysses.data.tokenizer import ByteTokenizer
sources.JSONL_CHUNK_BYTES = 300  # many work items
tok = ByteTokenizer()
real = TextEncoder(tok)
def slow(where, row):
    time.sleep(0.003)
    return real(where, row)
files = sources.list_files({path!r})
key = token_store.cache_key(files, token_store.tokenizer_identity(tok), {{"kind": "text"}})
open({ready!r} + sys.argv[1], "w").close()
while not all(os.path.exists({ready!r} + r) for r in "01"):  # start together
    time.sleep(0.01)
store = token_store.build_or_open(sources.work_items(files), slow, {cache!r}, key, tok.vocab_size, {{}})
np.save({out!r} + sys.argv[1] + ".npy", np.asarray(store.tokens))
print("STORE", store.folder, flush=True)
"""


@pytest.mark.slow
def test_two_jobs_building_the_same_new_corpus_both_succeed(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    write_text_corpus(str(corpus), n_docs=200)
    script = BUILDER.format(root=ROOT, ready=str(tmp_path / "ready"), path=str(corpus), cache=str(cache),
                            out=str(tmp_path / "tokens"))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    folders = {line.split()[1] for out, _ in outs for line in out.splitlines() if line.startswith("STORE")}
    assert len(folders) == 1 and stores(cache) == [os.path.basename(folders.pop())]
    a, b = (np.load(tmp_path / f"tokens{i}.npy") for i in range(2))
    assert a.size > 0 and np.array_equal(a, b)
    assert any("waiting for another process building" in out for out, _ in outs)  # one built, one waited
    assert os.listdir(cache) == stores(cache)  # no parts, no temporary folder, no lock file


def test_dead_builders_leftovers_are_removed_and_a_live_builders_kept(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    write_text_corpus(str(corpus))
    config = load_config(["--training.dataset", "text", "--training.dataset_path", str(corpus),
                          "--training.dataset_cache_dir", str(cache)])
    os.makedirs(cache)
    dead = ["0123456789abcdef0123.parts-otherhost-deadbeef", "0123456789abcdef0123.tmp-otherhost-4242"]
    for d in dead + ["fedcba9876543210fedc.parts-host-cafe"]:
        os.makedirs(cache / d)
        (cache / d / "part-000000.npz").write_bytes(b"x" * 100)
    live = BuildLock(str(cache / "fedcba9876543210fedc")).acquire()  # another job building its own key now
    try:
        store = open_store("text", str(corpus), ByteTokenizer(), config)
    finally:
        live.release(built=False)
    assert litter(cache) == ["fedcba9876543210fedc.parts-host-cafe"]  # the live one is kept
    assert stores(cache) == [os.path.basename(store.folder)]


def _fail_writes_after(monkeypatch, target: str, n_ok: int):
    real = getattr(token_store, target)
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] > n_ok:
            if target == "_merge_into":
                os.makedirs(args[0])
                open(os.path.join(args[0], "tokens.bin"), "wb").write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(token_store, target, failing)


@pytest.mark.parametrize("target, n_ok", [("_write_atomic_npz", 2), ("_merge_into", 0)], ids=["parts", "merge"])
def test_a_full_disk_is_one_line_with_free_and_needed_space_and_no_leftovers(tmp_path, monkeypatch, target, n_ok):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    write_text_corpus(str(corpus), n_docs=100)
    monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 500)
    _fail_writes_after(monkeypatch, target, n_ok)
    config = load_config(["--training.dataset", "text", "--training.dataset_path", str(corpus),
                          "--training.dataset_cache_dir", str(cache)])
    with pytest.raises(DataError, match=r"^no space left for the token store .*: [\d.]+ \w+ free, about "
                                        r"[\d.]+ \w+ needed") as e:
        open_store("text", str(corpus), ByteTokenizer(), config)
    assert "\n" not in str(e.value)
    assert not litter(cache) and not stores(cache)
    monkeypatch.undo()
    assert open_store("text", str(corpus), ByteTokenizer(), config).n_docs == 100  # a rerun builds


# --- the corpus fingerprint: a changed corpus is a changed data setting --------------------------

def test_rows_appended_between_save_and_resume_are_refused(tmp_path):
    corpus = tmp_path / "corpus"
    write_text_corpus(str(corpus))
    argv = ["--training.dataset", "text", "--training.dataset_path", str(corpus), "--training.seq_len", "32",
            "--training.local_batch_size", "4"]
    data = build_data(load_config(argv), ByteTokenizer(), 0, 1, 4, verbose=False)
    next(iter(data.dataloader))
    state = data.dataloader.state_dict()
    write_text_corpus(str(corpus), n_docs=5, start=60)  # rows appended
    resumed = build_data(load_config(argv), ByteTokenizer(), 0, 1, 4, verbose=False)
    with pytest.raises(DataError, match=r"other data settings \(dataset_content '\w+' -> '\w+'\)"):
        resumed.dataloader.load_state_dict(state)
    allowed = build_data(load_config([*argv, "--checkpoint.allow_data_change", "true"]), ByteTokenizer(), 0, 1, 4,
                         verbose=False)
    allowed.dataloader.load_state_dict(state)
    # a checkpoint from before the fingerprint was recorded still resumes
    old = json.loads(state["dataset_state"]["data_settings"])
    old.pop("dataset_content"), old.pop("tokenizer_content")
    legacy = dict(state, dataset_state=dict(state["dataset_state"], data_settings=json.dumps(old)))
    resumed.dataloader.load_state_dict(legacy)


def test_tokenizer_spelling_is_not_a_data_change_but_its_content_is(tmp_path):
    hf, corpus = tmp_path / "hf", tmp_path / "corpus"
    make_tokenizer(str(hf))
    write_text_corpus(str(corpus))
    base = ["--training.dataset", "text", "--training.dataset_path", str(corpus), "--training.seq_len", "16",
            "--model.tokenizer", "hf", "--training.local_batch_size", "4"]

    def data(*extra):
        config = load_config([*base, *extra])
        return build_data(config, resolve_tokenizer(config.model), 0, 1, 4, verbose=False)

    first = data("--model.hf_assets_path", str(hf))
    next(iter(first.dataloader))
    state = first.dataloader.state_dict()
    data("--model.tokenizer_path", str(hf / "tokenizer.json")).dataloader.load_state_dict(state)
    swap_two_token_ids(hf / "tokenizer.json")
    with pytest.raises(DataError, match=r"tokenizer_content 'hf-\w+"):
        data("--model.hf_assets_path", str(hf)).dataloader.load_state_dict(state)


# --- SIGTERM while tokenizing exits 0 ----------------------------------------------------------

@pytest.mark.slow
def test_sigterm_while_tokenizing_exits_0_and_the_rerun_builds(tmp_path):
    corpus, dump = tmp_path / "corpus", tmp_path / "run"
    os.makedirs(corpus)
    line = json.dumps({"text": "x" * 4000}) + "\n"
    with open(corpus / "big.jsonl", "w") as f:
        f.write(line * 12000)  # ~48 MB: tokenizing takes seconds
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--training.dataset", "text",
            "--training.dataset_path", str(corpus), "--training.seq_len", "64", "--training.steps", "1",
            "--training.local_batch_size", "1", "--job.dump_folder", str(dump), "--checkpoint.enable", "false",
            "--model.flavor", "debugmodel", "--parallelism.ulysses_degree", "1"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    seen = ""
    deadline = time.time() + 240
    while "tokenizing" not in seen and time.time() < deadline:
        char = proc.stderr.read(1)
        if not char:
            break
        seen += char
    assert "tokenizing" in seen, seen[-2000:]
    proc.terminate()  # SIGTERM
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (seen + err)[-3000:]
    assert "SIGTERM during start-up, before the first step: nothing to save; exiting 0" in err
    assert "Traceback" not in err
    cache = corpus / ".titan_cache"
    assert not [d for d in os.listdir(cache) if ".tmp-" in d]  # whole parts at most, kept for the rerun
