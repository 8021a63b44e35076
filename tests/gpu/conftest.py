"""Every test in this folder runs on a CUDA device: marked ``gpu`` (``-m gpu`` selects them) and
skipped, with the reason shown, where there is none. They are the GPU suite's correctness cases
(``scripts/gpu_suite.py`` runs the same functions in time-boxed parts); on CPU their code still runs
at toy size in ``tests/test_gpu_suite.py``'s dry runs, which these skips do not replace."""

import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    # a conftest's hook sees the whole session's items: only this folder's are marked
    no_cuda = pytest.mark.skip(reason="no CUDA device: tests/gpu checks CUDA paths (their CPU dry run is "
                                      "tests/test_gpu_suite.py)")
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(no_cuda)
