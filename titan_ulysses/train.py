"""Entry point: `torchrun --nproc-per-node N train.py --config X [--section.key value ...]`, where X is a
TOML file or the name of a shipped config (``debug_model``); `torchrun -m titan_ulysses.train` and the
installed `titan-train` (one process) run the same ``cli``. The repository's train.py is a wrapper.

`python train.py --help` lists every setting with its default and docstring; `--help SECTION` one section's.

`python train.py --config X --dry-run --world-size N [--device-memory-gib G] [--device-name H100|H200] [...]`
runs every check a launch makes for N ranks, without a process group, prints the plan and
exits 0, or prints the one-line refusal and exits 2 (``titan_ulysses/preflight.py``'s ``plan``).

A configuration error, a dump folder in use by another run, a run whose checkpoints are all
damaged, or a start checkpoint (``checkpoint.initial_load_path``) that fails verification ends every rank with exit code 2 and one line on stderr, printed by rank 0 only (every rank finds the same error; the others wait
a moment so that rank 0 is the failure torchrun reports). Under torchrun
the launcher then reports the failed workers (``exitcode: 2``) and exits 1 itself: torchrun
exits 1 whenever a worker fails. Its report ends with the same line (rank 0 writes it to
torchrun's error file, which the report's ``traceback :`` field shows), so the refusal is both
the first line of the failure and the last.

A checkpoint save that fails (a full disk) ends the run with exit code 1 and one line the same way
(``checkpoint error: ...``: the space needed and free, and what makes room); the last good
checkpoint is kept.
"""

import os
import signal
import sys
import time
import warnings

PREEMPTED_NOTE = ("during start-up, before the first step: nothing to save; exiting 0 (a rerun resumes from the "
                  "run's newest checkpoint; a token store build resumes from its whole parts)")


class PreemptedAtStartup(BaseException):  # like KeyboardInterrupt: no `except Exception` swallows it
    """SIGTERM/SIGUSR1 before the first step: nothing to save yet, so the rank stops and exits 0
    (the training loop installs its own handler, which finishes the step and saves)."""


def _preempted(signum, frame):
    raise PreemptedAtStartup(signal.Signals(signum).name)


def _preempted_while_importing(signum, frame):
    print(f"{signal.Signals(signum).name} {PREEMPTED_NOTE}", file=sys.stderr, flush=True)
    os._exit(0)


# torchdata's StatefulDataLoader calls a deprecated torch API on every construction
warnings.filterwarnings("ignore", message=".*set_vital.*")

EXIT_REFUSED = 2
EXIT_FAILED = 1  # a run that started and failed in a way it explains in one line (a checkpoint save)
RANK0_FIRST_S = 3.0
DRY_RUN_OPTIONS = {"--world-size": int, "--device-memory-gib": float, "--device-name": str}  # only with --dry-run


def dry_run_options(argv: list[str]) -> tuple[list[str], dict | None]:
    """(the config's arguments, the dry run's options or None when ``--dry-run`` is absent)."""
    from titan_ulysses.config.manager import ConfigError

    rest, options, i = [], {}, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if argv[i] == "--dry-run":
            options["dry_run"] = True
        elif name in DRY_RUN_OPTIONS:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            try:
                options[name] = DRY_RUN_OPTIONS[name](value)
            except ValueError:
                options[name] = None
            if options[name] is None or (not isinstance(options[name], str) and options[name] <= 0):
                raise ConfigError(f"{name} expects a positive {DRY_RUN_OPTIONS[name].__name__}, got {value!r}")
        else:
            rest.append(argv[i])
        i += 1
    if not options:
        return rest, None
    if "dry_run" not in options:
        raise ConfigError(f"{next(iter(options))} is an option of --dry-run; under torchrun the launcher sets the "
                          f"world size")
    return rest, {"world_size": options.get("--world-size", 1), "device_gib": options.get("--device-memory-gib"),
                  "device_name": options.get("--device-name")}


def tell_launcher(line: str) -> None:
    """Under torchrun, the refusal in the worker's error file: torchrun's closing report ("Root Cause ...
    traceback :") then repeats it after its own ChildFailedError traceback, instead of a link to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line above on stderr stays the refusal


def main(argv: list[str]) -> int:
    # the imports below take seconds (torch): cli() exits 0 on a preemption meanwhile
    from titan_ulysses.config.help import help_command

    shown = help_command(argv)
    if shown is not None:  # --help [SECTION], or no argument at all: the usage and the shipped configs
        return shown

    from titan_ulysses.config.manager import ConfigError, load_config
    from titan_ulysses.data.sources import DataError
    from titan_ulysses.checkpoint.errors import RunRefused, SaveFailedError  # a folder in use, ...; a full disk
    from titan_ulysses.interop.peft_export import AdapterMismatchError
    from titan_ulysses.checkpoint.verify import UntrustedCheckpointError  # initial_load_path, a resume step

    previous = {sig: signal.signal(sig, _preempted) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        argv, dry = dry_run_options(argv)
        config = load_config(argv)
        if dry is not None:
            from titan_ulysses.preflight import plan

            print(plan(config, dry["world_size"], dry["device_gib"], dry["device_name"]), flush=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            return 0
        from titan_ulysses.trainer import Trainer

        trainer = Trainer(config)
    except PreemptedAtStartup as e:
        print(f"{e} {PREEMPTED_NOTE}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)  # no teardown: peers may be inside a collective this rank will never join
    except (ConfigError, DataError, RunRefused, AdapterMismatchError, UntrustedCheckpointError) as e:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if os.environ.get("RANK", "0") == "0":
            kind = "config error" if isinstance(e, ConfigError) else "data error" if isinstance(e, DataError) else "refused"
            print(f"{kind}: {e}", file=sys.stderr, flush=True)
            tell_launcher(f"{kind}: {e}")
        else:
            # Let rank 0 print and exit first: torchrun stops every worker at the first failure
            # it sees, and would otherwise often stop rank 0 before it says why. Its SIGTERM
            # then ends this rank quietly, as start-up preemption does (exit 0): the refusal is
            # rank 0's, and torchrun's report names it alone rather than this rank too.
            for sig in previous:
                signal.signal(sig, lambda signum, frame: os._exit(0))
            time.sleep(RANK0_FIRST_S)
        return EXIT_REFUSED
    import torch

    try:
        trainer.train()
    except torch.OutOfMemoryError as e:  # every rank: one line (phase, asked and free, the prediction, what fits)
        from titan_ulysses.planning.oom import oom_line

        line = oom_line(e, trainer.config, trainer.parallel_dims, trainer.spec.args, trainer.step + 1)
        print(f"out of memory: {line}", file=sys.stderr, flush=True)
        tell_launcher(f"out of memory: {line}")
        return EXIT_FAILED
    except SaveFailedError as e:  # every rank's save failed: one line (where, space needed and free, what to do)
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"checkpoint error: {e.strerror}", file=sys.stderr, flush=True)
            tell_launcher(f"checkpoint error: {e.strerror}")
        return EXIT_FAILED
    return 0


def cli(argv: list[str] | None = None) -> None:
    """The command: ``main`` on the command line's arguments, then the process group's teardown; never returns."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _preempted_while_importing)
    code = main(sys.argv[1:] if argv is None else argv)
    from titan_ulysses.distributed.setup import leave_job  # here: the heavy imports come after the handlers above

    leave_job(code)


if __name__ == "__main__":
    cli()
