"""Where this run's weights come from: one decision, in one order, named in the start-up line.

1. this run's newest good checkpoint (``checkpoint.folder``: the full training state);
2. ``checkpoint.initial_load_path`` (a ``step-N`` of another run: the model only, or the
   full state with ``checkpoint.initial_load_model_only = false``);
3. the safetensors weights of ``model.hf_assets_path`` (unless ``checkpoint.initial_load_in_hf``
   is set to false: the folder then gives the architecture only);
4. a random init (``training.seed``).

A run whose checkpoints are all damaged (every ``step-N`` failed verification or loading and
was set aside as ``step-N.bad``) does not fall through to 2-4: it stops with
``AllCheckpointsDamagedError`` naming them and the choices, unless the user asks for a fresh
start with ``checkpoint.allow_fresh_start = true``. The ``.bad`` folders stay, so a rerun
refuses again rather than silently starting over.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from titan_ulysses.checkpoint.errors import RunRefused

_BAD_DIR = re.compile(r"^step-(\d+)\.bad(-\d+)?$")


class AllCheckpointsDamagedError(RunRefused):
    """Every checkpoint of the run is damaged; the run refuses to start over silently."""


@dataclass(frozen=True)
class WeightSource:
    kind: str  # "checkpoint" | "initial_load_path" | "hf" | "random"
    path: str = ""
    step: int = 0
    model_only: bool = True
    seed: int = 0
    why: str = "no checkpoint, initial_load_path or Hugging Face weights"  # of a random init

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"step-{self.step} of this run ({self.path})"
        if self.kind == "initial_load_path":
            what = "model only" if self.model_only else f"full state, step {self.step}"
            return f"checkpoint.initial_load_path {self.path} ({what})"
        if self.kind == "hf":
            return f"the Hugging Face folder {self.path} (its safetensors)"
        return f"random init (training.seed {self.seed}; {self.why})"


def hf_has_weights(folder: str) -> bool:
    return bool(folder) and bool(glob.glob(os.path.join(folder, "*.safetensors")))


def hf_weights_wanted(config) -> bool:
    """Whether the run's fresh start (no checkpoint of its own) loads model.hf_assets_path's weights.

    ``checkpoint.initial_load_in_hf`` true/false decides when set; unset (None), the folder's
    weights are loaded when it has safetensors and no ``initial_load_path`` comes first
    (never in ``comm.mode = "fake"``, whose weights are not real).
    """
    c, m = config.checkpoint, config.model
    if c.initial_load_in_hf is not None:
        return bool(c.initial_load_in_hf)
    if c.initial_load_path or config.comm.mode == "fake":
        return False
    return hf_has_weights(m.hf_assets_path)


def fresh_source(config) -> WeightSource:
    """The source of a fresh start (steps 2-4 above), without loading anything."""
    c = config.checkpoint
    if c.initial_load_path:
        return WeightSource("initial_load_path", c.initial_load_path, model_only=c.initial_load_model_only)
    if hf_weights_wanted(config):
        return WeightSource("hf", config.model.hf_assets_path)
    path = config.model.hf_assets_path
    if path and c.initial_load_in_hf is False:
        return WeightSource("random", seed=config.training.seed,
                            why=f"checkpoint.initial_load_in_hf false: only the architecture of {path}")
    if path and config.comm.mode != "fake":
        return WeightSource("random", seed=config.training.seed, why=f"{path} has no *.safetensors")
    return WeightSource("random", seed=config.training.seed)


def adopt_start_record(config, shards: tuple[int, int] | None = None) -> str | None:
    """Verify a ``checkpoint.initial_load_path`` and take its architecture from its own record.

    The first reader of the start checkpoint, so it verifies it (``verify.py``) before anything
    reads it: its small files here (``shards`` None: a launch's ranks checksum the shards together
    at the load), or everything (``shards`` ``verify.ALL``: the dry run, one process). A path that is
    not a complete checkpoint is left to ``preflight.check_files``, which names the steps there.

    A checkpoint of a run started from a Hugging Face folder carries that folder's config.json
    and tokenizer files (``hf_assets/``): without ``model.hf_assets_path``, the run uses them
    (context extension needs no second flag). Sets ``config.model.hf_assets_path``; returns a
    note for the start-up line, or None when nothing was taken. Checkpoints of flavor runs keep
    ``model.flavor``; a mismatch is refused by the shape check, naming the flavor recorded.
    """
    from titan_ulysses.interop.hf_export import ASSETS
    from titan_ulysses.checkpoint.steps import missing_checkpoint
    from titan_ulysses.checkpoint.verify import verify_checkpoint

    c, m = config.checkpoint, config.model
    if not c.initial_load_path or missing_checkpoint(c.initial_load_path):
        return None
    verify_checkpoint(c.initial_load_path, "checkpoint.initial_load_path", shards)
    if m.hf_assets_path:
        return None
    assets = os.path.join(c.initial_load_path, ASSETS)
    if not os.path.isfile(os.path.join(assets, "config.json")):
        return None
    m.hf_assets_path = assets
    return f"model.hf_assets_path not set: the architecture is that of the start checkpoint ({assets})"


def damaged_checkpoints(folder: str) -> list[str]:
    """The ``step-N.bad`` folders set aside in ``folder``, newest step first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := _BAD_DIR.match(name))]
    return [name for _, name in sorted(found, reverse=True)]


def _all_damaged(folder: str, bad: list[str], fresh: WeightSource) -> AllCheckpointsDamagedError:
    return AllCheckpointsDamagedError(
        f"every checkpoint of this run is damaged ({', '.join(bad)} in {folder}; the warnings above say why), so "
        f"the run does not start over from {fresh.describe()} by itself. Choices: restore a good copy as "
        f"{folder}/step-N and rerun; or start over from {fresh.describe()} with --checkpoint.allow_fresh_start "
        f"true (the .bad folders are kept); or use another job.dump_folder / checkpoint.folder"
    )


def load_start_weights(config, checkpointer, model, init_random, init_adapters=None) -> WeightSource:
    """Decide where the weights come from, load them into ``model`` and return the source. Collective.

    ``checkpointer`` is the run's CheckpointManager (its folder is this run's checkpoint folder);
    ``init_random()`` initialises the model's weights from ``training.seed``; ``init_adapters()``
    (LoRA runs) gives the adapters their initial values, which a checkpoint then replaces. The
    model's buffers must be initialised already.
    """
    c = config.checkpoint
    fresh = fresh_source(config)
    if init_adapters is not None:
        init_adapters()
    if c.enable:
        step = checkpointer.load()
        if step > 0:
            return WeightSource("checkpoint", checkpointer.step_dir(step), step)
        bad = checkpointer.from_rank0(damaged_checkpoints(checkpointer.folder) if checkpointer.rank == 0 else None)
        if bad and not c.allow_fresh_start:
            raise _all_damaged(checkpointer.folder, bad, fresh)
    if fresh.kind == "initial_load_path":
        if fresh.model_only:
            checkpointer.load_model_only(fresh.path)
            return fresh
        step = checkpointer.load_from(fresh.path)
        return WeightSource("initial_load_path", fresh.path, step, model_only=False)
    if fresh.kind == "hf":
        from titan_ulysses.interop.hf_weights import load_hf_weights

        load_hf_weights(model, fresh.path)
        return fresh
    init_random()
    if init_adapters is not None:
        init_adapters()  # again: a base init may touch them (deterministic: the same values)
    return fresh
