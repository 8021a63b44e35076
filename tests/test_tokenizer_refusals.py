"""Issue 33, damaged tokenizer files: each is refused by the pre-flight, before any process group,
in one line naming the file (and the line or field where there is one):

* a truncated tokenizer.json or tokenizer_config.json of the model folder;
* a chat template with a jinja syntax error (a ``chat_template.jinja``, or the ``chat_template``
  of tokenizer_config.json): named with its line, where it used to be blamed on the first row;
* a tokenizer_config.json that disagrees with tokenizer.json: a special token tokenizer.json does
  not have (the EOS silently became config.json's), or an ``added_tokens_decoder`` entry that
  tokenizer.json holds at another id.
"""

import json
import os
import shutil
import sys

import pytest
import torch.distributed as dist

from hf_fixtures import make_hf_model, make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    make_hf_model(str(folder), "llama", {})
    make_tokenizer(str(folder))
    return folder


@pytest.fixture
def folder(model_folder, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_folder, copy)
    return copy


@pytest.fixture
def corpus(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(row) for _ in range(8)) + "\n")
    return path


def _refusal(folder, tmp_path, capsys, *extra, dry_run=False):
    """train.py's one line for a run from ``folder`` (its tokenizer), refused before any process group."""
    sys.path.insert(0, ROOT)
    import train

    argv = ["--model.hf_assets_path", str(folder), "--model.tokenizer", "hf", "--parallelism.ulysses_degree", "1",
            "--job.dump_folder", str(tmp_path / "run"), *extra] + (["--dry-run"] if dry_run else [])
    capsys.readouterr()
    assert train.main(argv) == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_truncated_tokenizer_files_are_named(folder, tmp_path, capsys):
    text = (folder / "tokenizer.json").read_text()
    (folder / "tokenizer.json").write_text(text[: len(text) // 2])
    line = _refusal(folder, tmp_path, capsys)
    assert line.startswith(f"config error: model.hf_assets_path '{folder}': {folder}/tokenizer.json is not a valid "
                           f"tokenizer.json ("), line
    (folder / "tokenizer.json").write_text(text)
    config = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").write_text(config[: len(config) // 2])
    line = _refusal(folder, tmp_path, capsys)
    assert line.startswith(f"config error: model.hf_assets_path '{folder}': {folder}/tokenizer_config.json is not "
                           f"valid JSON (") and " line " in line, line


def test_a_chat_template_that_does_not_parse_is_named_with_its_line(folder, corpus, tmp_path, capsys):
    sft = ["--training.dataset", "sft", "--training.dataset_path", str(corpus), "--training.seq_len", "64"]
    jinja = folder / "chat_template.jinja"
    jinja.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    expected = (f"data error: {jinja} line 2: the template does not parse (TemplateSyntaxError: unexpected '}}'); fix "
                f"the template, or name another with training.chat_template")
    assert _refusal(folder, tmp_path, capsys, *sft) == expected
    assert _refusal(folder, tmp_path, capsys, *sft, dry_run=True) == expected
    # the same in tokenizer_config.json's chat_template (no chat_template.jinja)
    os.remove(jinja)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% if messages %}{{ messages[0]['content'] }}{% endfi %}"
    config_path.write_text(json.dumps(config))
    line = _refusal(folder, tmp_path, capsys, *sft)
    assert line.startswith(f"data error: {config_path}'s chat_template line 1: the template does not parse "
                           f"(TemplateSyntaxError: "), line


def test_a_template_with_generation_tags_still_parses_in_a_fresh_process():
    """In a process that has not imported transformers (which imports jinja2.ext), as a launch's is."""
    import subprocess

    code = ("import sys; from titan_ulysses.data.chat import ChatTemplate; assert 'transformers' not in sys.modules; "
            "ChatTemplate(\"{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}\")")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_tokenizer_config_that_disagrees_with_the_tokenizer_is_refused(folder, tmp_path, capsys):
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                    "eos_token_id": 1}))
    # an EOS token tokenizer.json does not have: it used to become config.json's eos_token_id silently
    config_path.write_text(json.dumps({**config, "eos_token": "<|eot_id|>"}))
    assert _refusal(folder, tmp_path, capsys) == (
        f"config error: model.hf_assets_path '{folder}': {config_path}: eos_token '<|eot_id|>' is not a token of "
        f"{folder}/tokenizer.json: the two files are of different tokenizers; copy both from one model (or fix "
        f"eos_token)")
    # an added token at an id where tokenizer.json has another
    decoder = {"0": {"content": "<|end_of_text|>", "special": True}}
    config_path.write_text(json.dumps({**config, "added_tokens_decoder": decoder}))
    assert _refusal(folder, tmp_path, capsys) == (
        f"config error: model.hf_assets_path '{folder}': {config_path}: added_tokens_decoder['0'] is "
        f"'<|end_of_text|>' but {folder}/tokenizer.json has '<|begin_of_text|>' at id 0: the two files are of "
        f"different tokenizers; copy both from one model")
    # the entries tokenizer.json agrees with pass
    config_path.write_text(json.dumps({**config, "added_tokens_decoder": {"1": {"content": "<|end_of_text|>"}}}))
    from titan_ulysses.interop.hf_tokenizer import HFTokenizer

    assert HFTokenizer(str(folder)).eos_id == 1


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_passkey_window_too_short_for_the_tokenizer_is_one_line(folder, tmp_path, capsys, dry_run):
    """The passkey sample is built in the data loader (a traceback there); its length depends on the
    tokenizer, so pre-flight builds one with the run's tokenizer."""
    line = _refusal(folder, tmp_path, capsys, "--training.dataset", "passkey", "--training.seq_len", "16",
                    dry_run=dry_run)
    assert line.startswith("config error: training.seq_len 16 is too short for a passkey sample with this "
                           "tokenizer (it needs at least "), line
    assert line.endswith("tokens): raise training.seq_len"), line
