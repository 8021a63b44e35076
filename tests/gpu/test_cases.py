"""The GPU suite's correctness cases as tests, at their GPU sizes: each must pass (a check with its
stated tolerance) or report a measurement; a case that cannot run here (a kernel this GPU lacks, a
package not installed) is skipped with its reason."""

import time

import pytest
import torch

from benchmarks.gpu_common import Case, Context, Skip

from . import correctness
from .models import families_bf16, moe_grouped_mm
from .multirank import features_multirank

CASES = [*correctness.CASES, Case("features_multirank", features_multirank, 30),
         Case("moe_grouped_mm_bf16", moe_grouped_mm, 10), Case("families_bf16", families_bf16, 15)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(case, tmp_path):
    ctx = Context(device=torch.device("cuda", 0), dry_run=False, out=str(tmp_path),
                  deadline=time.monotonic() + 3600)
    try:
        row = case.fn(ctx)
    except Skip as e:
        pytest.skip(str(e))
    finally:
        torch.cuda.empty_cache()
    if row["status"] == "skipped":
        pytest.skip(row.get("detail", ""))
    assert row["status"] in ("pass", "measured"), f"{row['status']}: {row.get('figures')} {row.get('detail')}"
