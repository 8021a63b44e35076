"""Pre-flight's layout checks are one table (``layout_checks.CHECKS``): every row runs, in order, and a new
check is one function plus one row."""

import pytest

from titan_ulysses import layout_checks
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.preflight import validate


def test_every_row_runs_in_order(monkeypatch):
    seen = []
    rows = tuple((name, (lambda n: lambda run: seen.append(n))(name), line) for name, _, line in layout_checks.CHECKS)
    monkeypatch.setattr(layout_checks, "CHECKS", rows)
    validate(load_config(["--parallelism.ulysses_degree", "2"]), 2)
    assert seen == [name for name, _, _ in rows]


def test_a_new_check_is_one_row(monkeypatch):
    def at_most_two_layers(run):
        if run.args.n_layers > 2:
            raise ValueError(f"{run.args.n_layers} layers")

    config = load_config([])
    validate(config, 1)
    row = ("a planted check", at_most_two_layers, "two layers at most: {e} ({source})")
    monkeypatch.setattr(layout_checks, "CHECKS", layout_checks.CHECKS + (row,))
    with pytest.raises(ConfigError, match=r"^two layers at most: \d+ layers \(model.flavor 'debugmodel'\)$"):
        validate(config, 1)


def test_the_first_refusal_is_framed_by_its_row():
    with pytest.raises(ConfigError, match=r"^training.seq_len: "):
        validate(load_config(["--parallelism.ulysses_degree", "2", "--training.seq_len", "1001"]), 2)
