"""The one protocol every metrics logger follows (torchtitan's pattern): rank 0 builds the
enabled loggers once, and each record of a step goes to all of them alike."""

from __future__ import annotations

from typing import Protocol


class Logger(Protocol):
    def log(self, metrics: dict) -> None:
        """One record: a training step's metrics, or a validation result; ``metrics["step"]`` is its step."""

    def log_summary(self, summary: dict) -> None:
        """The end-of-run summary (steps, tokens, wall time, losses, where the outputs are)."""

    def close(self) -> None:
        """Flush and release (files, writer threads, the W&B run)."""


def numeric(metrics: dict) -> dict[str, float]:
    """The int/float entries of ``metrics`` but ``step`` (what scalar loggers can plot)."""
    return {k: v for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
