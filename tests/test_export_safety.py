"""An export can never delete a run (issue 43, items 1-3): refused with or without --overwrite, every file of the
run unchanged by sha256, nothing left over beside it.

One short trainer run (checkpoints at steps 2 and 4, metrics, summary, locks) serves every case, through the
installed command's ``main`` and through ``scripts/export_hf.py``.
"""

import hashlib
import importlib.util
import os

import pytest

from helpers import ROOT, run
from titan_ulysses.runs.outputs import EXPORT_MARKER, is_previous_export
from titan_ulysses.tools import export_hf as tool


def _hashes(folder) -> dict:
    """sha256 of every file under ``folder`` (and every folder's name), by relative path."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames:
            found[os.path.relpath(os.path.join(dirpath, name), folder) + "/"] = "dir"
        for name in filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return found


def _script():
    spec = importlib.util.spec_from_file_location("export_hf_script", os.path.join(ROOT, "scripts", "export_hf.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_safety")
    run(1, ["--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
            ], tmp, "R")
    return tmp


@pytest.mark.slow
def test_an_export_never_replaces_a_run_or_a_checkpoint(run_folder, tmp_path, capsys, monkeypatch):
    tmp, R = run_folder, run_folder / "R"
    ckpt, source = R / "checkpoint", R / "checkpoint" / "step-4"
    assert {"metrics.jsonl", "checkpoint/step-2/", "checkpoint/step-4/.metadata"} <= set(_hashes(R))
    before = _hashes(tmp)
    monkeypatch.chdir(R / "checkpoint" / "step-2")  # "." and its parents: the current folder and above it
    cases = {  # output -> what the refusal names
        str(ckpt): "holds a run or a checkpoint (.run.lock, step-2, step-4)",  # item 1: every checkpoint
        str(R): "holds a run or a checkpoint (.run.lock, checkpoint/, metrics.jsonl, summary.json)",  # item 2
        str(source): "lies inside the checkpoint",
        str(R / "checkpoint" / "step-2"): "lies inside the checkpoint",
        str(ckpt / "hf"): "lies inside the checkpoint",  # beside the checkpoints: a resume scans this folder
        ".": "lies inside the checkpoint",
        "..": "holds a run or a checkpoint (.run.lock, step-2, step-4)",
        str(tmp): "holds a run or a checkpoint (R/)",
    }
    for main in (tool.main, _script().main):  # item 3: the script as the command
        for output, reason in cases.items():
            for more in ([], ["--overwrite"]):
                code = main(["--checkpoint", str(source), "--output", output, *more])
                err = capsys.readouterr().err
                assert code == 2 and reason in err and len(err.strip().splitlines()) == 1, (output, more, err)
                assert "pass --overwrite" not in err, err
                assert _hashes(tmp) == before, (output, more)  # nothing changed, nothing left (no .tmp-N)
    # the current folder, or one above it, that holds no run: refused in one line, nothing left over (..tmp-N)
    (tmp_path / "plain" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "plain" / "sub")
    for output, where in ((".", "the current folder"), ("..", "a folder above the current one")):
        code = tool.main(["--checkpoint", str(source), "--output", output, "--overwrite"])
        err = capsys.readouterr().err
        assert code == 2 and f"--output {output!r} is {where}" in err and len(err.strip().splitlines()) == 1, err
    assert _hashes(tmp_path) == {"plain/": "dir", "plain/sub/": "dir"}
    # a new folder in the run's dump folder is fine (the docs' outputs/R/hf), and --overwrite replaces it
    # only while it holds nothing but that export
    assert tool.main(["--checkpoint", str(source), "--output", str(R / "hf")]) == 0, capsys.readouterr().err
    assert is_previous_export(str(R / "hf")) and (R / "hf" / EXPORT_MARKER).exists()
    code = tool.main(["--checkpoint", str(source), "--output", str(R / "hf")])
    assert code == 2 and "holds a previous export" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(source), "--output", str(R / "hf"), "--overwrite"]) == 0
    (R / "hf" / "notes.txt").write_text("mine")  # no longer only an export: --overwrite is refused
    code = tool.main(["--checkpoint", str(source), "--output", str(R / "hf"), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a previous export" in err and "pass --overwrite" not in err, err
    assert (R / "hf" / "notes.txt").read_text() == "mine"
    after = _hashes(tmp)
    assert {k: v for k, v in after.items() if not k.startswith("R/hf")} == before
