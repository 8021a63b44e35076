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


@pytest.fixture(scope="session")
def smollm2_hf_folder(tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face folder (scripts/smollm2_folder.py), converted once per
    session for test_smollm2 and test_hf_ulysses (about 50 s on 2 cores)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("smollm2_folder", os.path.join(ROOT, "scripts", "smollm2_folder.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = str(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    assert script.main([folder, "--download"]) == 0, "scripts/smollm2_folder.py refused (its line above)"
    return folder
