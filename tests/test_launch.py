"""Multi-node launch (issue 24): scripts/launch_slurm.sh, run with stand-ins for srun and
scontrol, starts two torchrun "nodes" on this machine (c10d rendezvous, one worker each); their
losses equal the same job's in one node of two processes."""

import os
import socket
import stat
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from helpers import BASE, layout, read_metrics, train_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = BASE + layout(sp=2) + ["--training.steps", "3"]

# srun: one copy of its command per node, in parallel (what Slurm does with --ntasks-per-node=1)
SRUN = """#!/bin/bash
while [ "${1#--}" != "$1" ]; do shift; done
pids=()
for ((node = 0; node < SLURM_JOB_NUM_NODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" > "$LOGS/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
echo localhost
echo localhost
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stub(folder, name, text):
    path = folder / name
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.slow
def test_two_nodes_on_localhost_equal_one_node(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "srun", SRUN)
    _stub(bin_dir, "scontrol", SCONTROL)
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]]),
               PYTHONPATH=ROOT, OMP_NUM_THREADS="1", LOGS=str(tmp_path), SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="launch-test", SLURM_SUBMIT_DIR=ROOT, GPUS_PER_NODE="1",
               MASTER_PORT=str(_free_port()))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_slurm.sh"), *ARGS,
                           "--job.dump_folder", str(tmp_path / "two_nodes")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    logs = "".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1) if (tmp_path / f"node{n}.log").exists())
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "2 node(s) x 1 worker(s), rendezvous at localhost:" in proc.stdout
    two_nodes = [m["loss"] for m in read_metrics(tmp_path / "two_nodes")]

    run_distributed(train_worker, 2, ARGS + ["--job.dump_folder", str(tmp_path / "one_node")])
    one_node = [m["loss"] for m in read_metrics(tmp_path / "one_node")]
    assert len(two_nodes) == 3 and two_nodes == one_node


@pytest.mark.slow
def test_launch_slurm_outside_slurm_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch_slurm.sh")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr == ("launch_slurm.sh: not inside a Slurm job (no SLURM_JOB_NODELIST); submit it with sbatch\n")
