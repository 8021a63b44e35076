"""Never a raw out-of-memory (issue 44 item 3, ``planning/oom.py``): the launch refuses a layout predicted over the
device before the model is built, with the estimate, the device and the switch that fits, unless
``training.allow_over_memory_estimate``; a step that still runs out ends with one line naming the phase, the
bytes asked for and free, the prediction and the switch that fits. On CPU, with the device's memory and the
allocator's error planted (the launch on a GPU, 2026-11-28, raised a raw traceback from the loss's backward)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the allocator's message as CUDA writes it (torch 2.11 on an H100)
OOM = ("CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of 79.19 GiB of which 3.12 GiB "
       "is free. Including non-PyTorch memory, this process has 76.06 GiB memory in use.")


@pytest.fixture
def one_rank(tmp_path):
    """train.py's arguments for the debug model as rank 0 of a fake world of 2, in this process."""
    yield ["--config", os.path.join(ROOT, "train_configs", "debug_model.toml"), "--comm.mode", "fake",
           "--comm.fake_world_size", "2", "--training.local_batch_size", "1", "--training.steps", "1",
           "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
           "--job.dump_folder", str(tmp_path / "run")]
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_launch_refuses_a_layout_over_the_device_before_building_the_model(one_rank, train_main, monkeypatch,
                                                                             capsys):
    from titan_ulysses import preflight, trainer
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.inputs import GIB, from_config
    from titan_ulysses.planning.recommend import BUDGET

    config = load_config(one_rank)
    args, layout, switches = from_config(config, preflight.validate(config, 1))
    need = estimate(args, layout, switches, config.training.seq_len).total
    device = 0.8 * need  # the config's switches do not fit; stronger ones may
    monkeypatch.setattr(preflight, "device_total_memory", lambda d: (device, "a planted GPU"))

    def built(*a, **k):
        raise AssertionError("the model was built before the refusal")

    monkeypatch.setattr(trainer, "build_parallel_model", built)
    code, _, err = train_main(one_rank)
    assert code == 2 and len(err) == 1, err
    line = err[0]
    assert line.startswith(f"config error: the predicted peak of this layout is {need / GIB:.2f} GiB per device"), line
    assert f"more than the device's {device / GIB:.2f} GiB (a planted GPU;" in line, line
    fits = line.split("; at this layout ", 1)[1].split(": ", 1)[0].split()  # the switches named
    assert fits and fits[0].startswith("--"), line
    flags = dict(zip(fits[::2], fits[1::2]))
    fitted = load_config([*one_rank, *fits])
    a2, l2, s2 = from_config(fitted, preflight.validate(fitted, 1))
    assert estimate(a2, l2, s2, config.training.seq_len).total <= BUDGET * device, flags
    assert line.endswith("training.allow_over_memory_estimate true launches it anyway"), line
    # the setting lets a user who knows better go ahead: rank 0 warns, the launch goes on (this rank joined the
    # fake world before the refusal)
    allowed = load_config([*one_rank, "--training.allow_over_memory_estimate", "true"])
    preflight.check_device(allowed, preflight.validate(allowed, 1), torch.device("cpu"))
    assert capsys.readouterr().err.startswith("warning (training.allow_over_memory_estimate): the predicted peak")


def test_a_step_out_of_device_memory_ends_in_one_line(one_rank, train_main, monkeypatch):
    def backward(self, *a, **k):  # where the GPU ran out: the loss's backward
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    code, _, err = train_main(one_rank)
    assert code == 1, err
    assert not any("Traceback" in e for e in err), err
    lines = [e for e in err if e.startswith("out of memory: ")]
    assert len(lines) == 1, err
    line = lines[0]
    assert "step 1 ran out of device memory in backward: asked for 7.83 GiB with 3.12 GiB free of 79.19 GiB" in line
    assert "; the planner predicts " in line and " GiB for this layout (" in line, line
    assert "at this layout " in line and "(an H100 by the step-time model)" in line, line


def test_the_phase_comes_from_the_traceback():
    from titan_ulysses.planning.oom import phase_of

    def optimizer_step():
        raise torch.OutOfMemoryError(OOM)

    def forward():
        raise torch.OutOfMemoryError(OOM)

    for fn, phase in ((optimizer_step, "optimizer step"), (forward, "forward")):
        try:
            fn()
        except torch.OutOfMemoryError as e:
            assert phase_of(e.__traceback__) == phase
