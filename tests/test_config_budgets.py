"""Every shipped long-context config's device peak is under the budget its header states: ``recommend.BUDGET``
of the device it is written for (``--device-memory-gib G``, or ``80 GB``). Its estimate, and where that is
near the budget its peak tracked on CPU (``planning/track.py``: traced at three and four layers and a few
token quanta, extrapolated exactly). Issue 39: a model change added 2.9 GiB to the 8B at 6M's tracked peak,
past its 72 GiB, and nothing noticed (the estimate, arithmetic, cannot see a model change)."""

import dataclasses
import os
import re

import pytest

from test_dry_run import CONFIGS, written_world_size
from titan_ulysses.planning.inputs import GIB, from_config
from titan_ulysses.planning.recommend import BUDGET
from titan_ulysses.tools.estimate_memory import prepare

LONG_CONTEXT = 131072
"""Tokens per sequence from which a shipped config counts as long-context."""


def written_device(path: str) -> float | None:
    """GiB of the device a config's header is written for: ``--device-memory-gib G``, or the first ``G GB``."""
    header = open(path).read().split("\n[", 1)[0]
    found = re.search(r"--device-memory-gib (\d+)", header) or re.search(r"(\d+) GB\b", header)
    return float(found.group(1)) if found else None


def _long_context(path: str) -> bool:
    seq = re.search(r"^seq_len = (\d+)", open(path).read(), re.M)
    return seq is not None and int(seq.group(1)) >= LONG_CONTEXT


def _model_shipped(path: str) -> bool:
    """Whether the model a config names can be read here (a Hugging Face folder it names must be shipped:
    ``llama3_8b_128k_from_hf`` names a download, the shape and switches of ``llama3_8b_128k``)."""
    folder = re.search(r'^hf_assets_path = "([^"]+)"', open(path).read(), re.M)
    return folder is None or os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(path)), folder.group(1)))


LONG_CONFIGS = [p for p in CONFIGS if _long_context(p) and _model_shipped(p)]


def test_every_long_context_config_names_its_device():
    assert LONG_CONFIGS and all(written_device(p) for p in LONG_CONFIGS), \
        [os.path.basename(p) for p in LONG_CONFIGS if not written_device(p)]


TRACKED_FROM = 0.95
"""Configs whose estimate is above this share of their budget are tracked (a tracker run costs 30-40 s of CPU
for the 8B at 6M and the 1B at 2M, minutes for the 8B at 1.2M in groups of 16 layers); below it the estimate
leaves 5% of the budget free, more than the tracker has been above the estimate (3.5%: the 8B at 6M in issue
39) and than the change that issue found (4%)."""


@pytest.mark.parametrize("path", LONG_CONFIGS, ids=os.path.basename)
def test_tracked_peak_is_under_the_header_budget(path):
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.track import track_step

    world, gib = written_world_size(path), written_device(path)
    config, spec, dims = prepare(["--config", path], world)
    args, layout, switches = from_config(config, dims, spec.args)
    t = config.training
    budget = BUDGET * gib * GIB
    est = estimate(args, layout, switches, t.seq_len, t.local_batch_size).total
    assert est <= budget, f"{os.path.basename(path)}: estimate {est / GIB:.2f} GiB over {BUDGET:.0%} of {gib:g} GiB"
    if est <= TRACKED_FROM * budget:
        return  # the estimate leaves 5% of the budget free (TRACKED_FROM)
    step = track_step(args, layout, switches, t.seq_len, t.local_batch_size)
    assert step.peak <= budget, (f"{os.path.basename(path)}: tracked device peak {step.peak / GIB:.2f} GiB "
                                 f"over {BUDGET:.0%} of {gib:g} GiB ({step.traced})")


def test_an_80_gb_device_refuses_the_selective_headline_layout_and_names_what_fits_there():
    """Issue 39: the 8B at 128K over sp=8 with selective AC peaked at 86.8 GiB on an H200 (out of memory on an
    H100). The warning the dry run raises on 80 GB names the memory switch that fits at this layout, a 141 GB
    device takes it as it is, and the plan says which device it needs."""
    from titan_ulysses.planning.estimate import estimate
    from titan_ulysses.planning.recommend import DEVICES, at_this_layout, devices_that_fit, memory_warning

    config, spec, dims = prepare(["--config", os.path.join(os.path.dirname(CONFIGS[0]), "llama3_8b_128k.toml"),
                                  "--activation_checkpoint.mode", "selective"], 8)
    args, layout, switches = from_config(config, dims, spec.args)
    t = config.training
    total = estimate(args, layout, switches, t.seq_len, t.local_batch_size).total
    (h100, h100_gib), (h200, h200_gib) = DEVICES
    assert h100_gib * GIB < total <= BUDGET * h200_gib * GIB  # the case: over an H100, within an H200
    warning = memory_warning(config, dims, 8, h100_gib * GIB, spec.args)
    flags, fitting = at_this_layout(args, layout, switches, t.seq_len, t.local_batch_size, BUDGET * h100_gib * GIB)
    assert f"at this layout {' '.join(flags)} fits ({fitting.total / GIB:.1f} GiB)" in warning
    assert fitting.total <= BUDGET * h100_gib * GIB < total
    assert memory_warning(config, dims, 8, h200_gib * GIB, spec.args) is None
    assert f"more than an {h100} ({h100_gib:g} GB); fits an {h200} ({h200_gib:g} GB)" in devices_that_fit(total)
    # full AC, the shipped mode, fits an H100 as it is
    full = estimate(args, layout, dataclasses.replace(switches, ac_mode="full"), t.seq_len, t.local_batch_size).total
    assert f"fits an {h100} ({h100_gib:g} GB) or an {h200} ({h200_gib:g} GB)" in devices_that_fit(full)
