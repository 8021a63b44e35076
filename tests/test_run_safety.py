"""Faults a long run must survive (issue 15), end to end with the trainer on gloo.

Each test is a failure seen on the code before issue 15: a NaN learning rate on resume
saved NaN weights as good; a resumed run ignored ``--optimizer.lr``; a damaged newest
checkpoint was not survived; a full disk crashed every rerun; two runs shared a folder; a
frozen rank stalled the job for 30 minutes; ranks outlived their launcher; a config error
was printed once per rank.
"""

import contextlib
import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from helpers import BASE, layout, read_metrics
from titan_ulysses.config.manager import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
FAST = BASE + layout(sp=2) + ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]


def _train(argv, hook=None):
    from titan_ulysses.trainer import Trainer

    trainer = Trainer(load_config(argv))
    if hook == "nan_lr":  # what `--lr_scheduler.min_lr_factor nan` did before validation refused it
        for group in trainer.optimizer.param_groups:
            group["lr"] = float("nan")
    if hook in ("nan_grad_at_2", "nan_grad_rank1_at_2"):
        import titan_ulysses.trainer as trainer_module

        real_clip = trainer_module.clip_grad_norm_

        def nan_norm(params, max_norm):
            norm = real_clip(params, max_norm)
            nan = trainer.step == 1 and (hook == "nan_grad_at_2" or dist.get_rank() == 1)
            return norm * float("nan") if nan else norm

        trainer_module.clip_grad_norm_ = nan_norm
    if hook == "nan_grad_rank1_at_2":  # step 2's update must leave every rank's weights and optimizer as they were
        step_fn = trainer.train_step

        def unchanged(data_iter):
            before = _state(trainer) if trainer.step == 1 else None
            out = step_fn(data_iter)
            if before is not None:
                after = _state(trainer)
                changed = [name for name in before if not torch.equal(before[name], after[name])]
                assert not changed and before.keys() == after.keys(), f"rank {dist.get_rank()}: {changed[:4]}"
            return out

        trainer.train_step = unchanged
    if hook == "disk_full_at_4":
        _full_disk_at(4)
    if hook == "stall_rank1_at_2" and dist.get_rank() == 1:
        step_fn = trainer.train_step

        def stall(data_iter):
            if trainer.step == 1:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: its sockets stay open
            return step_fn(data_iter)

        trainer.train_step = stall
    trainer.train()


def _state(trainer) -> dict:
    """This rank's shards of the weights and of the optimizer's state (moments and step counts), copied."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": local(v) for k, v in trainer.model.state_dict().items()}
    for i, state in enumerate(trainer.optimizer.state.values()):
        out.update({f"optimizer.{i}.{k}": local(v) for k, v in state.items()})
    return out


def _full_disk_at(step):
    """The checkpoint writer's streams of ``step-{step}.tmp`` fail half-way with ENOSPC."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        if f"step-{step}.tmp" in str(path) and "w" in mode:
            with real(self, path, mode) as f:
                f.write(b"half a shard")
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
        with real(self, path, mode) as f:
            yield f

    FileSystem.create_stream = full_disk


def _main_on_a_full_disk(argv):
    """train.py's main, as the command runs it, with the disk full at step 4's save: exit code 1."""
    sys.path.insert(0, ROOT)
    import train

    _full_disk_at(4)
    assert train.main(argv) == 1


def run(argv, folder, hook=None, world=2):
    run_distributed(_train, world, FAST + argv + ["--job.dump_folder", str(folder)], hook)
    return read_metrics(folder)


def steps_on_disk(folder):
    return sorted(n for n in os.listdir(os.path.join(folder, "checkpoint")) if n != ".run.lock")  # the run's lock


# -- non-finite state never saved; on resume the config wins -----------------------------------

def test_nan_lr_on_resume_saves_nothing_and_a_lower_lr_is_applied(tmp_path, capfd):
    folder = tmp_path / "run"
    run(["--training.steps", "2", "--checkpoint.keep_latest_k", "1"], folder)
    with pytest.raises(Exception, match=r"learning rate is nan at step 3; stopping before the optimizer step, "
                                        r"nothing saved; the newest checkpoint, step-2, is kept"):
        run(["--training.steps", "4", "--checkpoint.keep_latest_k", "1"], folder, "nan_lr")
    assert steps_on_disk(folder) == ["step-2"]
    capfd.readouterr()
    # the guide's advice after a NaN: rerun with a lower learning rate; it must apply
    metrics = run(["--training.steps", "3", "--optimizer.lr", "1e-3", "--training.max_norm", "0.5"], folder)
    out = capfd.readouterr().out
    assert "starting at step 2; resumed: the config changes optimizer.lr 0.003 -> 0.001, training.steps 2 -> 3, " \
           "training.max_norm 1.0 -> 0.5" in out, out
    assert metrics[-1]["step"] == 3 and metrics[-1]["lr"] == pytest.approx(1e-3)  # warmup over: the peak
    assert steps_on_disk(folder) == ["step-2", "step-3"]
    assert os.path.isfile(folder / "checkpoint" / "step-3" / "manifest.json")


def test_a_nonfinite_grad_norm_skips_the_update_or_stops(tmp_path, capfd):
    # step 2 neither logs nor saves: its skip is decided on the device alone (sync_free_step) and read at step 3;
    # rank 1 alone sees the NaN, yet both skip (the hook checks that weights and optimizer state are bit-identical)
    metrics = run(["--training.steps", "3", "--training.skip_nonfinite_steps", "1", "--metrics.log_freq", "10",
                   "--checkpoint.interval", "10"], tmp_path / "skip", "nan_grad_rank1_at_2")
    assert "another rank's loss or gradient norm is NaN/inf at step 2 (loss " in capfd.readouterr().out  # rank 0's
    assert [m["step"] for m in metrics] == [1, 3] and "skipped" not in metrics[1]
    # the schedule did not advance over the skipped step: step 3 uses step 2's learning rate
    assert metrics[1]["lr"] == pytest.approx(2e-3)
    with pytest.raises(Exception, match=r"gradient norm is nan at step 2 \(loss .*\); stopping before the optimizer "
                                        r"step, nothing saved; no checkpoint has been saved yet"):
        run(["--training.steps", "3"], tmp_path / "stop", "nan_grad_at_2")


# -- a dump folder relaunched with another model: refused, nothing called damaged (issue 38) -----

def _dry_run(argv, capfd):
    sys.path.insert(0, ROOT)
    import train

    capfd.readouterr()
    code = train.main(argv + ["--dry-run", "--world-size", "2"])
    out, err = capfd.readouterr()
    return code, out, err.strip().splitlines()


def _another_model_is_refused_before_any_load(folder, capfd):
    """A dump folder relaunched with another model (issue 38): the dry run and the launch refuse it in one
    line naming the setting; nothing is loaded and no good checkpoint is renamed .bad."""
    argv = FAST + ["--job.dump_folder", str(folder), "--training.steps", "6"]
    gqa = ["--model.flavor", "debugmodel_gqa1"]
    code, out, err = _dry_run(argv + gqa, capfd)
    assert code == 2 and err == [
        "config error: the resumed checkpoint was trained with other model settings (model.flavor 'debugmodel' -> "
        "'debugmodel_gqa1'); nothing was loaded: set them back, resume on purpose with --checkpoint.override_recorded "
        "model.flavor, or train these settings from the start in another job.dump_folder (or checkpoint.folder)"], err
    with pytest.raises(Exception, match=r"checkpoint .*step-4 is good but does not fit this run's model: .*it records "
                                        r"model.flavor 'debugmodel': set --model.flavor debugmodel \(settings changed: "
                                        r"model.flavor 'debugmodel' -> 'debugmodel_gqa1'\); nothing was loaded or set "
                                        r"aside: set the settings back to resume, or train these settings"):
        run(["--training.steps", "6", *gqa, "--checkpoint.override_recorded", "model.flavor"], folder)
    assert steps_on_disk(folder) == ["step-2", "step-4"]  # never renamed .bad; the rerun below resumes from them


# -- a damaged newest checkpoint falls back; a full disk keeps the last good one ------------

def test_damaged_checkpoint_falls_back_and_a_full_disk_keeps_the_last_good_one(tmp_path, capfd):
    folder = tmp_path / "run"
    run(["--training.steps", "4"], folder)
    _another_model_is_refused_before_any_load(folder, capfd)
    shard = folder / "checkpoint" / "step-4" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bytes changed inside a tensor file
    shard.write_bytes(bytes(data))
    capfd.readouterr()
    # the rerun falls back to step-2; then its save of step 4 finds the disk full: one line, no traceback, and
    # advice that fits a folder of one checkpoint (keep_latest_k cannot free anything)
    run_distributed(_main_on_a_full_disk, 2, FAST + ["--training.steps", "6", "--job.dump_folder", str(folder)])
    err = capfd.readouterr().err
    assert f"{shard} does not match its checksum" in err and "falling back to the previous checkpoint" in err
    errors = [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and re.fullmatch(
        r"checkpoint error: no space left on device while saving .*step-4.tmp: a checkpoint of this run needs about "
        r"\d+\.\d\d GiB and \d+\.\d\d GiB are free on that filesystem; the newest good checkpoint, .*step-2, is kept\. "
        r"Free .*, or point checkpoint.folder at a filesystem with room \(keep_latest_k cannot help: the folder holds "
        r"1 checkpoint and the newest is always kept\), and rerun: the leftover step-4.tmp .*", errors[0]), errors
    assert steps_on_disk(folder) == ["step-2", "step-4.bad", "step-4.tmp"]
    with open(folder / "metrics.jsonl") as f:
        assert all(line.endswith("\n") and json.loads(line) for line in f)
    metrics = run(["--training.steps", "6"], folder)  # the leftover .tmp is removed at start-up
    assert [m["step"] for m in metrics][-4:] == [3, 4, 5, 6]  # from step-2 again
    assert steps_on_disk(folder) == ["step-2", "step-4", "step-4.bad", "step-6"]
    assert os.path.isfile(folder / "checkpoint" / "step-6" / "manifest.json")


def test_metrics_lines_stay_whole_when_a_write_fails(tmp_path, monkeypatch):
    from titan_ulysses.metrics import logger as metrics_logger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo')  # a line cut by an older crash
    log = metrics_logger.MetricsLogger(str(tmp_path), 0)
    assert path.read_text() == '{"step": 1}\n'
    real = os.write

    def short_write(fd, data):
        real(fd, data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_logger.os, "write", short_write)
    row = {"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec_per_device": 1.0, "max_memory_gib": 0}
    with pytest.raises(OSError, match=rf"cannot append a line of \d+ bytes to {path} \(No space left on device; "
                                      r"\d+ bytes free on that filesystem\)"):
        log.log(row)
    assert path.read_text() == '{"step": 1}\n'


# -- one run per dump folder; stalls and orphans end ------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_rank(argv, rank, world, port, hook="none"):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join([ROOT, TESTS]), OMP_NUM_THREADS="1")
    code = "import sys; from test_run_safety import _train; _train(sys.argv[2:], sys.argv[1])"
    return subprocess.Popen([sys.executable, "-c", code, hook, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_second_run_on_a_folder_in_use_is_refused_and_the_first_finishes(tmp_path):
    folder = tmp_path / "run"
    argv = BASE + layout() + ["--training.steps", "3", "--checkpoint.enable", "true", "--job.dump_folder", str(folder)]
    first = _spawn_rank(argv, 0, 1, _free_port())
    lock = folder / ".run.lock"
    _wait_for(lambda: lock.exists() and f'"pid": {first.pid}' in lock.read_text(), 120, "the first run took no lock")
    first.send_signal(signal.SIGSTOP)  # hold it mid-run, lock taken
    try:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="1", PYTHONPATH=ROOT)
        second = subprocess.run([sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"refused: job.dump_folder {folder} is in use by another run "
                                                   f"(pid {first.pid} on host {socket.gethostname()}"), second.stderr
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert [m["step"] for m in read_metrics(folder)] == [1, 2, 3]
    assert steps_on_disk(folder) == ["step-3"]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_within_the_train_timeout(tmp_path):
    port = _free_port()
    # start-up's timeout (init) far above communicate's bound below: only the train timeout can end rank 0 in time
    argv = BASE + layout(sp=2) + ["--training.steps", "50", "--comm.train_timeout_seconds", "3",
                                  "--comm.init_timeout_seconds", "900", "--job.dump_folder", str(tmp_path / "run")]
    ranks = [_spawn_rank(argv, r, 2, port, "stall_rank1_at_2") for r in range(2)]
    try:
        def stopped():
            with open(f"/proc/{ranks[1].pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"

        _wait_for(stopped, 120, "rank 1 never reached step 2")
        _, err = ranks[0].communicate(timeout=300)  # TimeoutExpired (a failure) if it waits for the init timeout
        assert ranks[0].returncode != 0
        # the collective's own timeout error (gloo's), turned into the one-line reason
        assert "step 2: a collective waited longer than comm.train_timeout_seconds (3s)" in err, err[-2000:]
    finally:
        for p in ranks:
            p.kill()
            p.communicate()


@pytest.mark.slow
def test_ranks_exit_when_their_launcher_dies(tmp_path):
    child = (f"import sys, time; sys.path.insert(0, {ROOT!r}); "
             "from titan_ulysses.distributed.watchdog import exit_with_launcher; "
             "exit_with_launcher(poll_seconds=0.2); print('ready', flush=True); time.sleep(120)")
    launcher = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
                "print(p.pid, flush=True); p.wait()")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdout=subprocess.PIPE, text=True)
    worker = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()  # SIGKILL: the launcher cannot pass anything on
    proc.wait()

    def gone():
        try:
            with open(f"/proc/{worker}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    _wait_for(gone, 10, "the worker outlived its launcher")


@pytest.mark.slow
def test_a_config_error_under_torchrun_is_printed_once():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
         "--optimizer.beta1", "2.0"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    refusal = "config error: optimizer.beta1 must lie in [0, 1), got 2.0"
    # once by rank 0 (not once per rank), and again as the last line of torchrun's report
    assert proc.stderr.count(refusal) == 2 and proc.stderr.count(f"traceback : {refusal}") == 1, proc.stderr
    assert "exitcode  : 2" in proc.stderr  # each worker exits 2 ...
    assert proc.returncode == 1  # ... and torchrun itself exits 1, as the README says


def test_a_checkpoint_folder_shared_by_two_dump_folders_is_locked(tmp_path):
    from titan_ulysses.runs.lock import RunLock

    shared = tmp_path / "shared_checkpoints"  # an absolute checkpoint.folder: outside either dump folder
    held = RunLock(str(shared), "checkpoint.folder")  # run A, alive, in another dump folder
    held.acquire()
    try:
        with pytest.raises(Exception, match=rf"checkpoint.folder {shared} is in use by another run \(pid "
                                            rf"{os.getpid()} .*; stop that run or choose another checkpoint.folder"):
            run(["--training.steps", "2", "--checkpoint.folder", str(shared)], tmp_path / "b")
    finally:
        held.release()
    assert os.listdir(shared) == [".run.lock"]  # run B resumed nothing and saved nothing there
    run(["--training.steps", "2", "--checkpoint.folder", str(shared)], tmp_path / "b")  # free now
    assert sorted(os.listdir(shared)) == [".run.lock", "step-2"]
    assert not os.path.exists(tmp_path / "b" / "checkpoint")


def _lock_and_meet(dump):
    from titan_ulysses.checkpoint.build import lock_run_folders
    from titan_ulysses.runs.lock import FolderInUseError, RunLock

    locks = lock_run_folders(load_config(FAST + ["--job.dump_folder", dump]), dist.get_rank())  # run A
    # run B, another dump folder, its --checkpoint.folder naming A's: the lock it takes there is held
    with pytest.raises(FolderInUseError, match=r"checkpoint.folder .*/a/checkpoint is in use by another run"):
        RunLock(os.path.join(dump, "checkpoint"), "checkpoint.folder").acquire()
    for lock in locks:
        lock.release()


def test_the_folder_checkpoints_are_written_to_is_locked_inside_the_dump_folder_too(tmp_path):
    run_distributed(_lock_and_meet, 1, str(tmp_path / "a"))


@pytest.mark.slow
def test_lock_refusals_and_stale_locks_where_flock_is_missing(tmp_path, monkeypatch):
    from titan_ulysses.runs import lock as lock_module
    from titan_ulysses.runs.lock import FolderInUseError, RunLock

    held = RunLock(str(tmp_path))
    assert held.acquire() is None
    with pytest.raises(FolderInUseError, match=rf"job.dump_folder {tmp_path} is in use by another run \(pid {os.getpid()}"):
        RunLock(str(tmp_path)).acquire()
    held.release()

    def no_flock(fd, operation):  # e.g. NFS without lock support: the lock file's content decides
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    path = tmp_path / ".run.lock"
    dead = subprocess.Popen(["true"])
    dead.wait()
    here = socket.gethostname()
    path.write_text(json.dumps({"host": here, "pid": dead.pid, "pid_start": "1", "since": "then"}))
    lock = RunLock(str(tmp_path))
    assert f"took over the stale lock of pid {dead.pid} on host {here}" in lock.acquire()
    with pytest.raises(FolderInUseError, match=f"pid {os.getpid()} on host {here}"):
        RunLock(str(tmp_path)).acquire()  # a live holder on this host
    lock.release()
    path.write_text(json.dumps({"host": "elsewhere", "pid": 1, "pid_start": "1", "since": "then"}))
    with pytest.raises(FolderInUseError, match="pid 1 on host elsewhere"):
        RunLock(str(tmp_path)).acquire()  # another host, heartbeat fresh
    beat = time.time() - 60  # a heartbeat a minute old (two missed beats, a busy filesystem): still respected
    os.utime(path, (beat, beat))
    with pytest.raises(FolderInUseError, match="pid 1 on host elsewhere"):
        RunLock(str(tmp_path)).acquire()
    old = time.time() - lock_module.STALE_AFTER_S - 10
    os.utime(path, (old, old))
    lock = RunLock(str(tmp_path))
    assert "took over the stale lock of pid 1 on host elsewhere" in lock.acquire()
    lock.release()
