"""With ``pip install -e '.[dev]'`` alone (no torchao), the float8 tests skip naming the extra instead of failing."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a pytest subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOAT8_TESTS = [
    "tests/test_float8.py",
    "tests/test_lora.py::test_lora_layout_matches_single_process[sp2-float8-rowwise]",
    "tests/test_compile.py::test_compile_composes_with_tiled_mlp_chunked_loss_offload_and_float8[selective-True]",
    "tests/test_docs.py::test_troubleshooting_quote_for_float8_is_current",
]


def test_float8_tests_skip_naming_the_extra_without_torchao(tmp_path):
    # sitecustomize runs in every interpreter (spawned ranks too): torchao is then not importable
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torchao'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *FLOAT8_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert f"{len(FLOAT8_TESTS)} skipped" in text and "failed" not in text and "error" not in text.lower(), text
    assert text.count("needs the float8 extra (torchao): pip install -e '.[float8]'") == len(FLOAT8_TESTS), text
