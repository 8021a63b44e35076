"""A test that needs an optional extra skips, naming the extra and how to install it, when the extra is absent.

``pip install -e '.[dev]'`` alone has no torchao (the ``float8`` extra): its tests then show as
skipped with the install line under ``pytest -ra``, rather than failing on an ImportError.
torchao stays out of ``dev`` because its builds are tied to torch releases.
"""

import importlib.util

import pytest

EXTRAS = {"torchao": "float8"}


def _reason(module: str) -> str:
    extra = EXTRAS[module]
    return f"needs the {extra} extra ({module}): pip install -e '.[{extra}]'"


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None  # without importing it (torchao takes seconds)


def needs(module: str):
    """A mark that skips the test or case when ``module`` cannot be imported."""
    return pytest.mark.skipif(not installed(module), reason=_reason(module))


def importorskip(module: str):
    """``pytest.importorskip`` with the extra named (a module-level skip of a whole file)."""
    return pytest.importorskip(module, reason=_reason(module))
