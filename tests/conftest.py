import os
import sys

import pytest

# make `tests` helpers importable in spawned workers and in pytest alike
sys.path.insert(0, os.path.dirname(__file__))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def train_main(capsys):
    """``train.main(argv)`` in this process: (exit code, stdout, stderr lines)."""
    sys.path.insert(0, ROOT)
    import train

    def run(argv):
        capsys.readouterr()
        code = train.main(argv)
        captured = capsys.readouterr()
        return code, captured.out, captured.err.strip().splitlines()

    return run
