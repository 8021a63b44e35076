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


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect
def pytest_collection_modifyitems(config, items):
    """Mark the ``smoke`` selection (``tests/smoke.py``); a listed id its collected file lacks (whole files
    collected, not node ids) is an error."""
    from smoke import SMOKE_IDS

    found, files = set(), set()
    for item in items:
        node = os.path.relpath(str(item.path), ROOT) + "::" + item.name
        files.add(node.split("::")[0])
        if node in SMOKE_IDS:
            item.add_marker(pytest.mark.smoke)
            found.add(node)
    whole_files = not any("::" in arg for arg in config.args)
    lost = sorted(n for n in SMOKE_IDS - found if n.split("::")[0] in files) if whole_files else []
    if lost:
        raise pytest.UsageError(f"tests/smoke.py lists {lost[0]}, which its file no longer has; list its new id")


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
