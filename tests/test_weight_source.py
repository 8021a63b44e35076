"""Where a run's weights come from (issue 20, bugs 1 and 2): one decision, named in the start-up line.

In each start mode (a Hugging Face folder, checkpoint.initial_load_path, a flavor's random
init) a run whose checkpoints are all damaged stops, naming them and the choices, and keeps
stopping on reruns; with checkpoint.allow_fresh_start it starts over from exactly the start
weights of its mode, never from a random init it was not asked for. Before this, a run from a
Hugging Face folder whose checkpoints were damaged trained from random weights.
"""

import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from helpers import BASE, layout
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import check_files

FAST = BASE + layout(sp=2) + ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--training.seed", "7"]


def _start(argv, out, train):
    """Build the trainer (its weights are loaded there), save rank 0's full copy of them, maybe train."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from titan_ulysses.trainer import Trainer

    trainer = Trainer(load_config(argv))
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0 and out:
        torch.save(state, out)
    if train:
        trainer.train()


def _run(argv, folder, out="", train=False):
    run_distributed(_start, 2, FAST + argv + ["--job.dump_folder", str(folder)], out, train)


def _damage_every_checkpoint(folder):
    ckpt = folder / "checkpoint"
    steps = sorted(n for n in os.listdir(ckpt) if n.startswith("step-"))
    assert steps == ["step-1", "step-2"], steps
    for name in steps:
        meta = ckpt / name / ".metadata"
        data = meta.read_bytes()
        meta.write_bytes(data[: len(data) // 2])  # half of .metadata, as in the report
    return steps


def _assert_same(saved_file, expected: dict):
    saved = torch.load(saved_file)
    assert set(saved) == set(expected), sorted(set(saved) ^ set(expected))[:5]
    for name, value in expected.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)


def _random_init(args, seed):
    from titan_ulysses.models.decoder.model import Transformer

    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model.state_dict()


def _refuses_until_asked(argv, folder, capfd, source_line, keep=None, trained=False, refusals=2):
    """Every checkpoint damaged: refused (again on a rerun: the .bad folders keep it so); allow_fresh_start
    starts over."""
    if not trained:
        _run(argv + ["--training.steps", "2"], folder, train=True)
    if keep:
        shutil.copytree(folder / "checkpoint" / "step-2", keep)
    _damage_every_checkpoint(folder)
    capfd.readouterr()
    for _ in range(refusals):
        with pytest.raises(Exception, match=r"every checkpoint of this run is damaged \(step-2\.bad, step-1\.bad in "
                                            r".*; or start over from .* with --checkpoint\.allow_fresh_start true"):
            _run(argv + ["--training.steps", "4"], folder)
    assert sorted(n for n in os.listdir(folder / "checkpoint") if n != ".run.lock") == ["step-1.bad", "step-2.bad"]
    capfd.readouterr()
    _run(argv + ["--training.steps", "4", "--checkpoint.allow_fresh_start", "true"], folder, folder / "start.pt")
    out = capfd.readouterr().out
    assert f"weights from {source_line}" in out and "starting at step 0" in out, out[-2000:]
    return folder / "start.pt"


def test_flavor_run_and_initial_load_path_with_every_checkpoint_damaged(tmp_path, capfd):
    from titan_ulysses.interop.hf_export import read_model_weights
    from titan_ulysses.models.flavors import get_flavor

    short = []  # BASE: seq_len 128, the shortest a byte-level passkey sample fits
    a = tmp_path / "a"
    capfd.readouterr()
    _run(short + ["--training.steps", "2"], a, train=True)
    out = capfd.readouterr().out
    for step in (1, 2):  # a line per committed checkpoint: step, path, size, seconds
        assert re.search(rf"checkpoint: committed step {step} to {a}/checkpoint/step-{step} \(\d+\.\d MiB, "
                         rf"\d+\.\d s\)", out), out[-2000:]
    _run(short + ["--training.steps", "2"], a, train=True)  # rerun of a finished run
    assert "all 2 steps of training.steps are done (step-2 of this run" in capfd.readouterr().out
    start = tmp_path / "start" / "step-2"
    shutil.copytree(a / "checkpoint" / "step-2", start)

    # refusals of a start checkpoint name the fix: the steps that exist, the flavor it records
    def refusal(*argv):
        with pytest.raises(ConfigError) as e:
            check_files(load_config([*BASE, *argv]))
        return str(e.value)

    assert refusal("--checkpoint.initial_load_path", str(a / "checkpoint" / "step-41")) == (
        f"checkpoint.initial_load_path: '{a}/checkpoint/step-41' does not exist; the complete checkpoints in "
        f"{a}/checkpoint are step-1, step-2")
    assert refusal("--checkpoint.initial_load_path", str(start), "--model.flavor", "debugmodel_gqa1").endswith(
        "it records model.flavor 'debugmodel': set --model.flavor debugmodel")

    # a flavor run: its fresh start is the random init of training.seed, said as such
    saved = _refuses_until_asked(short, a, capfd, "random init (training.seed 7", trained=True, refusals=1)
    _assert_same(saved, _random_init(get_flavor("debugmodel"), 7))

    # a run from another run's checkpoint: its fresh start is that checkpoint's weights again
    saved = _refuses_until_asked(short + ["--checkpoint.initial_load_path", str(start)], tmp_path / "b", capfd,
                                 f"checkpoint.initial_load_path {start} (model only)", refusals=1)
    expected = read_model_weights(str(start))
    _assert_same(saved, expected)
    assert not torch.equal(expected["tok_embeddings.weight"], _random_init(get_flavor("debugmodel"), 7)[
        "tok_embeddings.weight"])  # trained: a random init would not pass for it


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import make_hf_model

    folder = tmp_path_factory.mktemp("hf") / "model"
    make_hf_model(str(folder), "llama", dict(tie_word_embeddings=False, rope_theta=10000.0))
    return folder


def _hf_weights(folder):
    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.interop.hf_config import load_hf_args

    model = Transformer(load_hf_args(str(folder)))
    load_hf_weights(model, str(folder))
    return model.state_dict()


def test_hf_folder_weights_by_default_and_after_every_checkpoint_is_damaged(tmp_path, capfd, hf_folder):
    # no initial_load_in_hf: a folder with weights is where the run starts (bug 2); after every
    # checkpoint is damaged, the fresh start is those weights again, never a random init (bug 1)
    hf = ["--model.hf_assets_path", str(hf_folder)]
    step2 = tmp_path / "kept" / "step-2"
    saved = _refuses_until_asked(hf, tmp_path / "run", capfd, f"the Hugging Face folder {hf_folder}", keep=step2)
    _assert_same(saved, _hf_weights(hf_folder))

    # context extension from that run's step-2 needs no model.hf_assets_path: its record gives the architecture
    _run(["--checkpoint.initial_load_path", str(step2), "--training.seq_len", "256", "--checkpoint.enable", "false"],
         tmp_path / "longer", tmp_path / "longer.pt")
    out = capfd.readouterr().out
    assert f"LlamaForCausalLM 2 layers, dim 64" in out and f"weights from checkpoint.initial_load_path {step2}" in out
    assert f"the architecture is that of the start checkpoint ({step2}/hf_assets)" in out, out[-2000:]
    from titan_ulysses.interop.hf_export import read_model_weights

    _assert_same(tmp_path / "longer.pt", read_model_weights(str(step2)))


def test_initial_load_in_hf_false_means_the_architecture_only(tmp_path, capfd, hf_folder):
    from titan_ulysses.interop.hf_config import load_hf_args

    _run(["--model.hf_assets_path", str(hf_folder), "--checkpoint.initial_load_in_hf", "false",
          "--checkpoint.enable", "false"], tmp_path / "run", tmp_path / "start.pt")
    out = capfd.readouterr().out
    assert "LlamaForCausalLM 2 layers, dim 64" in out and (
        f"weights from random init (training.seed 7; checkpoint.initial_load_in_hf false: only the architecture of "
        f"{hf_folder})") in out, out
    _assert_same(tmp_path / "start.pt", _random_init(load_hf_args(str(hf_folder)), 7))


def test_the_fresh_start_order_without_a_process_group(tmp_path):
    """Which source a fresh start takes for each combination of settings (no weights are read)."""
    from titan_ulysses.checkpoint.weight_source import damaged_checkpoints, fresh_source

    with_weights, without = tmp_path / "hf", tmp_path / "arch_only"
    for folder in (with_weights, without):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (with_weights / "model.safetensors").write_bytes(b"")

    def source(*argv):
        return fresh_source(load_config(list(argv)))

    assert source().kind == "random"
    assert source("--model.hf_assets_path", str(with_weights)).kind == "hf"  # unset: the folder's weights
    assert source("--model.hf_assets_path", str(with_weights), "--checkpoint.initial_load_in_hf", "true").kind == "hf"
    off = source("--model.hf_assets_path", str(with_weights), "--checkpoint.initial_load_in_hf", "false")
    assert off.kind == "random" and "initial_load_in_hf false" in off.describe()
    none = source("--model.hf_assets_path", str(without))
    assert none.kind == "random" and f"{without} has no *.safetensors" in none.describe()
    first = source("--model.hf_assets_path", str(with_weights), "--checkpoint.initial_load_path", "x/step-3")
    assert first.kind == "initial_load_path" and first.describe() == "checkpoint.initial_load_path x/step-3 (model only)"
    fake = source("--model.hf_assets_path", str(with_weights), "--comm.mode", "fake")
    assert fake.kind == "random"  # a fake process group never reads real weights

    for name in ("step-2.bad", "step-10.bad", "step-2.bad-2", "step-3", "step-4.tmp", ".run.lock"):
        (tmp_path / "ckpt" / name).mkdir(parents=True)
    assert damaged_checkpoints(str(tmp_path / "ckpt")) == ["step-10.bad", "step-2.bad-2", "step-2.bad"]



def _own_checkpoint_wins(folder):
    from helpers import checkpoint_setup, scramble, snapshot, tiny_train_step
    from titan_ulysses.checkpoint.weight_source import load_start_weights

    model, opt, loader, _, other = checkpoint_setup(os.path.join(folder, "other"))
    other.save(1)  # another run's checkpoint: this run's initial_load_path
    start = snapshot(model)
    model, opt, loader, _, own = checkpoint_setup(os.path.join(folder, "run"))
    tiny_train_step(model, opt)
    loader.n = 5
    own.save(5)  # this run's own, trained past the start
    expected = snapshot(model)
    config = load_config(["--checkpoint.enable", "true",
                          "--checkpoint.initial_load_path", os.path.join(folder, "other", "step-1")])

    def random_init():
        raise AssertionError("a run with a good checkpoint of its own never initialises at random")

    scramble(model)
    loader.n = 0
    source = load_start_weights(config, own, model, random_init)
    assert (source.kind, source.step, source.describe()) == (
        "checkpoint", 5, f"step-5 of this run ({os.path.join(folder, 'run', 'step-5')})")
    assert loader.n == 5
    from helpers import assert_equal

    assert_equal(snapshot(model), expected, "param")
    assert any(not torch.equal(start[k], expected[k]) for k in expected)  # the start would be told apart


def test_a_run_with_initial_load_path_resumes_from_its_own_checkpoint(tmp_path):
    """Issue 33's planted bug that only the damaged-checkpoint refusal caught: initial_load_path
    winning over the run's own good checkpoint. A run that has one resumes from it (its weights,
    step and loader), whatever initial_load_path says: that is only where a fresh start begins."""
    run_distributed(_own_checkpoint_wins, 2, str(tmp_path))
