"""The metrics loggers, each a peer behind ``base.Logger``, and the registry that builds the
enabled ones (rank 0 only; the fan-out is ``metrics.logger.MetricsLogger``).

A registry row: name -> (is it enabled for these ``metrics`` settings, how to build it from
``(dump_folder, metrics settings, run config dict, resumed)``). A new logger is one file and one row.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from titan_ulysses.metrics.loggers.base import Logger


class Entry(NamedTuple):
    enabled: Callable[[object], bool]
    build: Callable[[str, object, dict, bool], Logger]


def _console(dump_folder, settings, run_config, resumed):
    from titan_ulysses.metrics.loggers.console import ConsoleLogger

    return ConsoleLogger()


def _jsonl(dump_folder, settings, run_config, resumed):
    from titan_ulysses.metrics.loggers.jsonl import JsonlLogger

    return JsonlLogger(dump_folder)


def _tensorboard(dump_folder, settings, run_config, resumed):
    from titan_ulysses.metrics.loggers.tensorboard import TensorboardLogger

    return TensorboardLogger(dump_folder)


def _wandb(dump_folder, settings, run_config, resumed):
    from titan_ulysses.metrics.loggers.wandb_logger import WandbLogger

    return WandbLogger(dump_folder, settings, run_config, resumed)


LOGGERS: dict[str, Entry] = {
    "console": Entry(lambda m: True, _console),
    "jsonl": Entry(lambda m: True, _jsonl),
    "tensorboard": Entry(lambda m: m.enable_tensorboard, _tensorboard),
    "wandb": Entry(lambda m: m.enable_wandb, _wandb),
}


def build_loggers(dump_folder: str, settings, run_config: dict | None = None, resumed: bool = False) -> list[Logger]:
    """The enabled loggers, in registry order; a failure closes the ones already built."""
    built: list[Logger] = []
    try:
        for entry in LOGGERS.values():
            if entry.enabled(settings):
                built.append(entry.build(dump_folder, settings, run_config or {}, resumed))
    except BaseException:
        for logger in built:
            logger.close()
        raise
    return built
