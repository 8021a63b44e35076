"""Plot one or more runs' metrics.jsonl: loss (and validation loss), learning rate, tokens/s per
device and peak memory over steps, the runs overlaid, into one PNG. The loss axis is logarithmic, sparse logs
and every run's last point get markers, and runs of very different lengths a logarithmic step axis.

    python scripts/plot_metrics.py outputs/A [outputs/B ...] [--out outputs/A/metrics.png]

A run resumed from an earlier checkpoint logs some steps twice; the later record of a step wins
(the curve the resumed run actually followed). A last line cut short (a run killed while writing
it) is skipped with a note; any other line that is not JSON is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from titan_ulysses.runs.outputs import output_problem

# panel title -> (metrics.jsonl key, y label, log scale)
PANELS = [
    ("loss", "loss", True),
    ("lr", "learning rate", False),
    ("tokens_per_sec_per_device", "tokens/s per device", False),
    ("max_memory_gib", "peak memory (GiB)", False),
]


def metrics_path(folder: str) -> str:
    """``folder/metrics.jsonl``, or one line naming it when it does not exist."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"plot_metrics: {path} does not exist (give the run's job.dump_folder)")
    return path


def read_run(folder: str) -> tuple[dict[int, dict], dict[int, float]]:
    """``(step -> training record, step -> validation loss)`` of ``folder/metrics.jsonl``, later lines winning."""
    path = metrics_path(folder)
    train, validation = {}, {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # the last line, cut short: a run killed while writing it
                    print(f"plot_metrics: {path}:{number}: skipped the last line, cut short (the run was stopped while "
                          f"writing it)", file=sys.stderr)
                    break
                raise SystemExit(f"plot_metrics: {path}:{number} is not JSON ({e.msg})") from e
            if "validation_loss" in row:
                validation[row["step"]] = row["validation_loss"]
            elif "loss" in row:
                train[row["step"]] = row
    if not train:
        raise SystemExit(f"plot_metrics: {path} has no training steps")
    return train, validation


SPARSE = 40
"""A run with at most this many points of a panel draws a marker on each (a line between far-apart logs hides them)."""
SPREAD = 10
"""When the longest run has at least this many times the steps of the shortest, the step axis is logarithmic."""


def _minor_label(value: float, _) -> str:
    """A log axis' labels between the powers of ten: 2, 3 and 5 times them (all eight crowd a short axis)."""
    mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0
    return f"{value:g}" if any(math.isclose(mantissa, m) for m in (2, 3, 5)) else ""


def plot(folders: list[str]):
    """The figure: one axis per panel, one line per run (validation loss dashed on the loss axis). The loss axis is
    logarithmic; sparse logs get markers, the last point of every run a marker, and runs of very different
    lengths a logarithmic step axis, so that a short run is not squeezed against the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    runs = [(os.path.basename(os.path.normpath(folder)), *read_run(folder)) for folder in folders]
    lasts = [max(train) for _, train, _ in runs]
    positive = {key: True for key, _, _ in PANELS}  # a log axis only where every value is above 0
    for name, train, validation in runs:
        steps = sorted(train)
        for ax, (key, label, _) in zip(axes.flat, PANELS):
            pairs = [(s, train[s][key]) for s in steps if train[s].get(key) is not None]
            if not pairs:
                continue
            marks = {"marker": "o", "markersize": 3} if len(pairs) <= SPARSE else {"marker": "o", "markevery": [-1]}
            line, = ax.plot([s for s, _ in pairs], [v for _, v in pairs], label=f"{name} ({steps[-1]} steps)",
                            gid=f"{name}:{key}", **marks)
            ax.set_title(label)
            positive[key] = positive[key] and all(v > 0 for _, v in pairs)
            if key == "loss" and validation:
                vs = sorted(validation)
                ax.plot(vs, [validation[s] for s in vs], "o--", color=line.get_color(), label=f"{name} validation",
                        gid=f"{name}:validation_loss")
                positive[key] = positive[key] and all(validation[s] > 0 for s in vs)
    for ax, (key, _, log) in zip(axes.flat, PANELS):
        if log and positive[key] and ax.lines:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 1, not 10^0
            low, high = ax.get_ylim()  # within a decade every minor tick is labelled: there may be no major one
            ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g") if high < 10 * low
                                         else matplotlib.ticker.FuncFormatter(_minor_label))
    if max(lasts) >= SPREAD * max(1, min(lasts)):
        axes[0, 0].set_xscale("log")  # shared by every panel
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="dump folders holding metrics.jsonl")
    p.add_argument("--out", default="", help="the PNG to write (default: metrics.png in the first run's folder)")
    a = p.parse_args(argv)
    out = a.out or os.path.join(a.runs[0], "metrics.png")
    for run in a.runs:  # the input first: a folder without metrics is named as such, not as a missing --out folder
        metrics_path(run)
    problem = output_problem("--out", out, overwrite=True, folder=False)  # a plot is redrawn in place
    if problem:
        raise SystemExit(f"plot_metrics: {problem}")
    fig = plot(a.runs)
    fig.savefig(out, dpi=100)
    print(f"wrote {out} ({len(a.runs)} run(s))")
    return 0


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
