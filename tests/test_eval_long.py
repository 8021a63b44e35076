"""eval_long on a checkpoint written by the trainer (issue 24): loss by position and needles in
real text give the same numbers at sp=2 (torchrun) as in one process; JSON and PNG agree."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "train_configs", "debug_model.toml")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import eval_long  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from dist_utils import run_distributed
    from helpers import train_worker

    dump = tmp_path_factory.mktemp("run")
    run_distributed(train_worker, 2, ["--config", CONFIG, "--training.steps", "2", "--training.seq_len", "128",
                                "--checkpoint.interval", "2", "--job.dump_folder", str(dump)])
    return os.path.join(dump, "checkpoint", "step-2")


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Real English text: this repository's README and data guide as two .txt documents."""
    folder = tmp_path_factory.mktemp("held_out")
    shutil.copy(os.path.join(ROOT, "README.md"), folder / "readme.txt")
    shutil.copy(os.path.join(ROOT, "docs", "data.md"), folder / "guide.txt")
    return str(folder)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, nproc=None):
    # one process: its own rendezvous port (the trainer's default 29500 may be taken on this machine)
    single = {} if nproc else dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] \
        if nproc else [sys.executable]
    proc = subprocess.run([*launcher, os.path.join("scripts", "eval_long.py"), *args], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, **single), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_eval_long_at_sp2_equals_one_process(checkpoint, held_out, tmp_path):
    common = ["--config", CONFIG, "--checkpoint", checkpoint, "--data", held_out, "--seq-len", "256",
              "--buckets", "4", "--max-docs", "2", "--keys", "1,3", "--needle-samples", "2"]
    _run([*common, "--output", str(tmp_path / "sp2")], nproc=2)
    _run([*common, "--output", str(tmp_path / "one"), "--parallelism.ulysses_degree", "1"])
    sp2, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("sp2", "one"))
    assert sp2["layout"]["sp"] == 2 and one["layout"]["sp"] == 1
    a, b = sp2["loss_by_position"], one["loss_by_position"]
    assert a["documents"] == 2 and a["bucket_starts"] == [0, 64, 128, 192] and a["bucket_ends"][-1] == 256
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert all(0.5 < v < 8 for v in b["loss"])  # a 2-step model on text: well above 0, finite
    assert sum(b["loss"]) / 4 == pytest.approx(b["mean_loss"], rel=1e-6)  # equal buckets
    assert sp2["needles"]["keys"] == [1, 3]
    assert sp2["needles"]["retrieved"] == one["needles"]["retrieved"]
    assert sp2["needles"]["token_accuracy"] == one["needles"]["token_accuracy"]
    assert sp2["needles"]["answer_nll"] == pytest.approx(one["needles"]["answer_nll"], rel=1e-4)
    import matplotlib.image

    assert matplotlib.image.imread(str(tmp_path / "sp2.png")).std() > 0.01  # the PNG opens and is drawn


def test_needle_window_holds_the_keys_in_the_text():
    from titan_ulysses.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    filler = list(tok.encode(open(os.path.join(ROOT, "README.md")).read(), False, False))
    tokens, start = eval_long.needle_window(tok, filler, 512, 3, 0)
    assert len(tokens) == 513 and tokens[0] == tok.bos_id
    text = tok.decode(tokens)
    assert text.count("The pass key of ") == 3 + 1  # three needles and the question
    asked = text.rsplit("What is the pass key of ", 1)[1].split("?")[0]
    key = tok.decode(tokens[start:]).strip()
    assert f"The pass key of {asked} is {key}. Remember it." in text and len(key) == 5


def test_eval_long_refuses_short_documents(checkpoint, held_out):
    with pytest.raises(SystemExit, match=r"^eval_long: no document of --data has 100001 tokens \(the longest has "):
        eval_long.main(["--config", CONFIG, "--checkpoint", checkpoint, "--data", held_out, "--seq-len", "100000",
                        "--parallelism.ulysses_degree", "1"])
