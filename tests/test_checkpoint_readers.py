"""Issue 33, item 1: every reader of a checkpoint verifies it against its manifest through one
function (``checkpoint/verify.py``) before it reads anything, and refuses a damaged one in one
line naming the file. The report's case: 400 bytes flipped in ``__0_0.distcp``, which
``export_hf.py`` exported silently (100 wrong values). Readers: the merged export, the
``--adapter-only`` export, ``eval_needle``, ``eval_long``, ``checkpoint.initial_load_path`` (dry
run and launch); resume's fallback past a damaged checkpoint is in ``test_checkpoint_trust.py``."""

import importlib.util
import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from helpers import BASE, add_manifest, layout, train_worker
from titan_ulysses.checkpoint.verify import UntrustedCheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "train_configs", "debug_model.toml")
RUN = BASE + layout(sp=2) + ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def _script(name):
    spec = importlib.util.spec_from_file_location(f"{name}_script", os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flip(path, count=400):
    """Invert ``count`` bytes in the middle of ``path`` (its size unchanged), as in the report."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(count)
        f.seek(-len(data), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint the trainer committed (model record, data settings, manifest) at sp=2."""
    dump = tmp_path_factory.mktemp("run")
    run_distributed(train_worker, 2, RUN + ["--training.steps", "1", "--job.dump_folder", str(dump)])
    return dump / "checkpoint" / "step-1"


@pytest.fixture
def flipped(good, tmp_path):
    step = tmp_path / "damaged" / "step-1"
    shutil.copytree(good, step)
    flip(step / "__0_0.distcp")
    return step


def _why(step):
    return f"{step}/__0_0.distcp does not match its checksum in the manifest (its bytes changed)"


def test_export_refuses_a_flipped_checkpoint(flipped, tmp_path, capsys):
    script = _script("export_hf")
    for extra in ([], ["--adapter-only"], ["--dtype", "bfloat16"]):
        out = tmp_path / f"out{len(extra)}"
        assert script.main(["--checkpoint", str(flipped), "--output", str(out), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"export_hf: --checkpoint: checkpoint {flipped} fails verification: {_why(flipped)}; nothing "
                       f"was read from it: point --checkpoint at another step-N (or restore this one from a good "
                       f"copy)"], err
        assert not out.exists()
    from titan_ulysses.interop.hf_export import export_hf

    with pytest.raises(UntrustedCheckpointError, match="__0_0.distcp does not match its checksum"):
        export_hf(str(flipped), None, str(tmp_path / "lib"))


def test_adapter_only_export_of_a_missing_path_says_it_does_not_exist(good, tmp_path, capsys):
    missing = good.parent / "step-7"
    script = _script("export_hf")
    assert script.main(["--checkpoint", str(missing), "--output", str(tmp_path / "o"), "--adapter-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"export_hf: '{missing}' does not exist; the complete checkpoints in {good.parent} are step-1"], err


DAMAGES = {  # the report's ten eval cases, per script: damage(step folder) -> the reason the refusal gives
    "flipped_shard": lambda d: (flip(d / "__0_0.distcp"), _why(d))[1],
    "missing_shard": lambda d: (os.remove(d / "__1_0.distcp"), f"{d}/__1_0.distcp is missing")[1],
    "truncated_shard": lambda d: (os.truncate(d / "__0_0.distcp", 100),
                                  f"{d}/__0_0.distcp has 100 bytes, the manifest says")[1],
    "broken_model_args": lambda d: ((d / "model_args.json").write_text("{"),
                                    f"{d}/model_args.json has 1 bytes, the manifest says")[1],
    "no_manifest": lambda d: (os.remove(d / "manifest.json"), f"{d} has no manifest.json, so it cannot be verified")[1],
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_evals_refuse_a_damaged_checkpoint_before_any_process_group(good, tmp_path, damage):
    """The script's SystemExit(message) is the one line ``python scripts/eval_*.py`` prints."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import eval_long
    import eval_needle

    step = tmp_path / "damaged" / "step-1"
    shutil.copytree(good, step)
    reason = DAMAGES[damage](step)
    (tmp_path / "held_out.txt").write_text("some text " * 100)
    for main, extra, prefix in ((eval_needle.main, [], ""),
                                (eval_long.main, ["--data", str(tmp_path / "held_out.txt")], "eval_long: ")):
        with pytest.raises(SystemExit) as e:
            main(["--config", CONFIG, "--checkpoint", str(step), "--parallelism.ulysses_degree", "1", *extra])
        message = e.value.code
        assert isinstance(message, str) and "\n" not in message, message
        assert message.startswith(f"{prefix}--checkpoint: checkpoint {step} fails verification: {reason}"), message
        assert not dist.is_initialized()


def _expected_start_refusal(step):
    return (f"refused: checkpoint.initial_load_path: checkpoint {step} fails verification: {_why(step)}; nothing "
            f"was read from it: point checkpoint.initial_load_path at another step-N (or restore this one from a "
            f"good copy)")


def test_initial_load_path_dry_run_refuses_a_flipped_checkpoint(flipped, tmp_path, capsys):
    sys.path.insert(0, ROOT)
    import train

    argv = [*BASE, "--checkpoint.initial_load_path", str(flipped), "--job.dump_folder", str(tmp_path / "run")]
    assert train.main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [_expected_start_refusal(flipped)], err


def _launch(argv):
    sys.path.insert(0, ROOT)
    import train

    assert train.main(argv) == 2


def test_initial_load_path_launch_refuses_a_flipped_checkpoint(flipped, tmp_path, capfd):
    """Before the process group only the small files are checked; the ranks checksum the shards
    together at the load, and every rank refuses in the same line (rank 0 prints it under torchrun)."""
    capfd.readouterr()
    run_distributed(_launch, 2, RUN + ["--checkpoint.initial_load_path", str(flipped),
                                       "--job.dump_folder", str(tmp_path / "run")])
    err, line = capfd.readouterr().err, _expected_start_refusal(flipped)
    # each rank prints it here (forked ranks have no RANK variable); their writes may interleave
    assert err.count(line) == 2 and not err.replace(line, "").strip(), err
    assert not os.path.exists(tmp_path / "run" / "checkpoint" / "step-1")


def test_the_manifest_covers_hf_assets(tmp_path):
    """``hf_assets/`` (config.json, tokenizer files, which an export copies) is listed and verified too."""
    import torch.distributed.checkpoint as dcp

    from hf_fixtures import make_tokenizer
    from model_harness import small_args
    from titan_ulysses.interop.hf_export import export_hf, write_model_record
    from titan_ulysses.checkpoint.manifest import read_manifest
    from titan_ulysses.models.decoder.model import Transformer

    source = tmp_path / "source"
    make_tokenizer(str(source))
    (source / "config.json").write_text('{"model_type": "llama"}')
    args = small_args()
    step = tmp_path / "step-1"
    dcp.save({"model": Transformer(args).state_dict()}, checkpoint_id=str(step), no_dist=True)
    write_model_record(str(step), args, str(source))
    add_manifest(step)
    assert {"hf_assets/tokenizer.json", "hf_assets/config.json", "model_args.json"} <= set(read_manifest(str(step)))
    export_hf(str(step), None, str(tmp_path / "ok"), torch.float32)
    flip(step / "hf_assets" / "tokenizer.json", 1)
    with pytest.raises(UntrustedCheckpointError, match=rf"{step}/hf_assets/tokenizer.json does not match its "
                                                       rf"checksum in the manifest"):
        export_hf(str(step), None, str(tmp_path / "bad"), torch.float32)
