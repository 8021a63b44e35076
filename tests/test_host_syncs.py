"""A step that logs nothing reads the device once: the non-finite guard, which reads the loss, the
gradient norm and the preemption flag together (the trainer's ``_read_guard`` says why it must).

On CPU nothing waits, so reads stand in for host syncs: a value read out of a tensor (``item``,
``tolist``, ``bool`` / ``float`` / ``int``, ``numpy``) by our own code. On CUDA each such read
blocks the host until the device has caught up, and the next step's kernels cannot queue.
Not covered here (passkey rows hold one document): packed rows add one read per microbatch,
where the attention mask cuts the documents on the host (``ops/attention/masks.py``).
"""

import os
import sys

import torch

import titan_ulysses
from dist_utils import run_distributed
from helpers import BASE, layout
from titan_ulysses.config.manager import load_config

PACKAGE = os.path.dirname(os.path.abspath(titan_ulysses.__file__))
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


def count_reads(reads: list, current: list):
    """Patch torch.Tensor's reads to append (current step, where) for each call from the package."""
    def counting(name, read):
        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                where = f"{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_lineno} {name}"
                reads.append((current[0], where))
            return read(self, *args, **kwargs)
        return counted

    for name in READS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))


def _reads_per_step(argv, folder):
    from titan_ulysses.trainer import Trainer

    trainer = Trainer(load_config(argv + ["--job.dump_folder", folder]))
    reads, current = [], [0]
    step_fn = trainer.train_step

    def tracked(*args, **kwargs):  # what follows a step (its line, the save) counts as that step's
        current[0] = trainer.step + 1
        return step_fn(*args, **kwargs)

    trainer.train_step = tracked
    count_reads(reads, current)
    trainer.train()
    by_step = {step: [where for s, where in reads if s == step] for step in (1, 2, 3)}
    assert by_step[1] and by_step[3], f"the logging steps read nothing: is the counter on? {reads}"
    assert len(by_step[2]) == 1, f"step 2 logs nothing, yet reads the device {len(by_step[2])} times: {by_step[2]}"
    assert "trainer.py" in by_step[2][0], by_step[2]


def test_a_step_that_logs_nothing_reads_the_device_once(tmp_path):
    # log_freq 10 over 3 steps: steps 1 and 3 (the first and the last) log, step 2 does not
    argv = BASE + layout(sp=2) + ["--training.steps", "3", "--metrics.log_freq", "10", "--checkpoint.enable", "false"]
    run_distributed(_reads_per_step, 2, argv, str(tmp_path / "run"))
