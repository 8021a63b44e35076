"""Plot one or more runs' metrics.jsonl: loss (and validation loss), learning rate, tokens/s per
device and peak memory over steps, the runs overlaid, into one PNG.

    python scripts/plot_metrics.py outputs/A [outputs/B ...] [--out outputs/A/metrics.png]

A run resumed from an earlier checkpoint logs some steps twice; the later record of a step wins
(the curve the resumed run actually followed). A last line cut short (a run killed while writing
it) is skipped with a note; any other line that is not JSON is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# panel title -> (metrics.jsonl key, y label, log scale)
PANELS = [
    ("loss", "loss", False),
    ("lr", "learning rate", False),
    ("tokens_per_sec_per_device", "tokens/s per device", False),
    ("max_memory_gib", "peak memory (GiB)", False),
]


def read_run(folder: str) -> tuple[dict[int, dict], dict[int, float]]:
    """``(step -> training record, step -> validation loss)`` of ``folder/metrics.jsonl``, later lines winning."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"plot_metrics: {path} does not exist (give the run's job.dump_folder)")
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


def plot(folders: list[str]):
    """The figure: one axis per panel, one line per run (validation loss dashed on the loss axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        train, validation = read_run(folder)
        steps = sorted(train)
        for ax, (key, label, _) in zip(axes.flat, PANELS):
            pairs = [(s, train[s][key]) for s in steps if train[s].get(key) is not None]
            line, = ax.plot([s for s, _ in pairs], [v for _, v in pairs], label=name, gid=f"{name}:{key}")
            ax.set_title(label)
            if key == "loss" and validation:
                vs = sorted(validation)
                ax.plot(vs, [validation[s] for s in vs], "o--", color=line.get_color(), label=f"{name} validation",
                        gid=f"{name}:validation_loss")
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="dump folders holding metrics.jsonl")
    p.add_argument("--out", default="", help="the PNG to write (default: metrics.png in the first run's folder)")
    a = p.parse_args(argv)
    out = a.out or os.path.join(a.runs[0], "metrics.png")
    fig = plot(a.runs)
    fig.savefig(out, dpi=100)
    print(f"wrote {out} ({len(a.runs)} run(s))")
    return 0


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
