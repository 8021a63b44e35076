"""Pre-flight: every check a launch makes before any process group, in one place above the packages.

``config/`` only parses and range-checks (``config/manager.py``'s ``check_config`` and
``check_requirements``, importing nothing else of ours). What needs the model, the
parallelism layout, this machine or the files the settings name is here:

* ``validate(config, world_size)``: the layout (``ParallelDims``), the heads and sequence
  length for it, the attention and float8 settings; reads the model's config.json when
  ``model.hf_assets_path`` is set (through ``models/resolve.py``);
* ``check_files(config)``: the tokenizer files, the chat template of an SFT dataset, the
  Hugging Face weights' safetensors headers, the DCP metadata of ``checkpoint.initial_load_path``.

The trainer runs both, in ``check_launch``, before it joins the process group, and
``check_device`` once it has.

``plan(config, world_size)`` is ``python train.py --config X --dry-run --world-size N``:
the two above for ``N`` ranks and what a launch finds out only once started (the output folders
and, with W&B on, a login: ``metrics/loggers/wandb_logger.py``'s ``login_problem``), then
``planning/dry_run.py``'s plan of what a launch finds out later still (model, layout, data, memory
by phase, what is saved where).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from titan_ulysses.runs.folders import output_folders_problem
from titan_ulysses.interop.hf_weights import check_hf_weights
from titan_ulysses.interop.hf_export import check_dcp_model_shapes
from titan_ulysses.interop.hub import resolve_hf_assets
from titan_ulysses.checkpoint.fit import check_resume
from titan_ulysses.checkpoint.verify import ALL
from titan_ulysses.checkpoint.weight_source import adopt_start_record, hf_weights_wanted
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, check_config, check_requirements
from titan_ulysses.data.build import check_dataset_files
from titan_ulysses.data.datasets import check_passkey_fits
from titan_ulysses.interop.hf_datasets import training_dataset_path
from titan_ulysses.interop.hf_tokenizer import hf_tokenizer_file
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.metrics.loggers.wandb_logger import login_problem
from titan_ulysses.layout_checks import Run, run_checks
from titan_ulysses.ops.attention import check_attention_settings
from titan_ulysses.run_spec import RunSpec, resolve_run, with_tokenizer


def validate(config: JobConfig, world_size: int, spec: RunSpec | None = None) -> ParallelDims:
    """Every setting's range and the cross-field checks that need only the world size (and the
    model: ``spec``'s, else resolved here without reading the tokenizer); returns the ParallelDims to build.

    In ``comm.mode = "fake"`` the job must be one process and the layout is checked
    against ``comm.fake_world_size``.
    """
    p = config.parallelism
    world_size = check_config(config, world_size)
    try:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, sp=p.ulysses_degree, tp=p.tensor_parallel_degree,
            ep=p.expert_parallel_degree, world_size=world_size,
        )
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from e
    args = (spec or resolve_run(config, tokenizer=False)).args
    source = f"model.hf_assets_path {config.model.hf_assets_path!r}" if config.model.hf_assets_path else (
        f"model.flavor {config.model.flavor!r}")
    run_checks(Run(config, dims, args, source))  # layout_checks.py: one row per component, in order
    check_requirements(config)
    return dims


def check_files(config: JobConfig, spec: RunSpec | None = None) -> RunSpec:
    """Every file a setting names exists and fits the model: one line naming the setting, before any weight is read.

    Separate from ``validate`` (which tools such as estimate_memory run on machines without
    the data); the trainer runs both before any process group starts. Returns the run's spec, its
    tokenizer read (``run_spec.resolve_run``: the ids against the model's vocabulary).
    """
    m, c = config.model, config.checkpoint
    if m.tokenizer == "tiktoken" and not os.path.isfile(m.tokenizer_path):
        raise ConfigError(f"model.tokenizer_path {m.tokenizer_path!r} is not a file (a Llama-3 tokenizer.model)")
    if m.tokenizer == "hf":
        try:
            hf_tokenizer_file(m.tokenizer_path or m.hf_assets_path)
        except FileNotFoundError as e:
            raise ConfigError(f"model.{'tokenizer_path' if m.tokenizer_path else 'hf_assets_path'}: {e}") from e
    # the file read whole (a broken tokenizer.json, no EOS, a garbage tiktoken file) and its ids
    # against the model's vocabulary, before any process group (issue 20)
    if spec is None:
        spec = resolve_run(config)
    elif spec.tokenizer_object is None:  # the model resolved already: its tokenizer only
        spec = with_tokenizer(config, spec)
    tokenizer, args = spec.tokenizer_object, spec.args
    if any(kind == "sft" for _, kind, _ in _datasets(config)):  # the chat template parses (a DataError naming it)
        from titan_ulysses.data.chat import load_chat_template

        load_chat_template(config.training.chat_template, tokenizer)
    if hf_weights_wanted(config):
        try:
            check_hf_weights(m.hf_assets_path, args)
        except (OSError, ValueError) as e:
            unset = "" if c.initial_load_in_hf else " (set checkpoint.initial_load_in_hf false to use its architecture only)"
            raise ConfigError(f"checkpoint.initial_load_in_hf: model.hf_assets_path {m.hf_assets_path!r}: {e}{unset}") from e
    if c.initial_load_path:
        try:
            check_dcp_model_shapes(c.initial_load_path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from e
    t, v = config.training, config.validation
    if "passkey" in (t.dataset, (v.dataset or t.dataset) if v.enable else None):
        try:  # a sample is built in the data loader's workers, where a refusal would be a traceback
            check_passkey_fits(spec.tokenizer_object, t.seq_len, t.passkey_digits)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return spec


def check_launch(config: JobConfig) -> tuple[ParallelDims, RunSpec, str | None]:
    """Every check a launch makes before it joins the process group, in the order that matters;
    returns the layout, the run's spec and the start record's note for the start-up line.

    A Hub id in ``model.hf_assets_path`` first becomes its snapshot folder (``interop/hub.py``);
    then the start checkpoint's record (it may give the architecture), the dataset files before
    the layout (a layout error must not hide a missing file), then ``validate``, ``check_files``
    and the output folder.
    """
    resolve_hf_assets(config)  # a Hub id -> its snapshot folder, before anything reads it
    note = adopt_start_record(config)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_dataset_files(config)
    spec = resolve_run(config, tokenizer=False)  # the tokenizer once check_files has checked its file
    dims = validate(config, world_size, spec)
    spec = check_files(config, spec)
    problem = output_folders_problem(config)
    if problem:
        raise ConfigError(problem)
    check_resume(config, spec.args)  # the checkpoint it would resume, of these settings (before any load)
    return dims, spec, note


def device_total_memory(device) -> tuple[float, str] | None:
    """(bytes, name) of ``device``'s memory; None where the planner has nothing to compare (a CPU)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return float(props.total_memory), props.name


def check_device(config: JobConfig, dims: ParallelDims, device, args=None) -> None:
    """The checks that need this rank's device, once it has joined the job and before the model is built: what
    the attention backend cannot do on it, and a layout whose predicted peak exceeds the device's memory
    (``planning/oom.py``; every rank finds the same; ``training.allow_over_memory_estimate`` makes it rank 0's
    warning)."""
    try:
        check_attention_settings(config.model.attn_backend, config.model.sdpa_backends, dims.cp, device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    memory = device_total_memory(device)
    if memory is not None:
        from titan_ulysses.planning.oom import launch_refusal  # the planner only when it may speak

        refusal = launch_refusal(config, dims, memory[0], args, memory[1])
        if refusal and not config.training.allow_over_memory_estimate:
            raise ConfigError(refusal)
        if refusal and dist.get_rank() == 0:
            print(f"warning (training.allow_over_memory_estimate): {refusal}", file=sys.stderr, flush=True)


def plan(config: JobConfig, world_size: int, device_gib: float | None = None, device_name: str | None = None) -> str:
    """Every pre-launch check for ``world_size`` ranks, then the plan (``planning/dry_run.py``) as text, or a
    ConfigError / DataError."""
    resolve_hf_assets(config)  # a Hub id -> its snapshot folder (downloaded unless HF_HUB_OFFLINE)
    # as the trainer: the start checkpoint may give the architecture; verified whole here (one process)
    record_note = adopt_start_record(config, shards=ALL)
    spec = resolve_run(config, tokenizer=False)  # the tokenizer once check_files has checked its file
    dims = validate(config, world_size, spec)
    spec = check_files(config, spec)
    # what a launch finds out only once started: the output folders, a W&B login (wandb.init)
    problem = output_folders_problem(config) or (login_problem() if config.metrics.enable_wandb else None)
    if problem:
        raise ConfigError(problem)
    check_resume(config, spec.args)  # as a launch: a checkpoint of other settings is refused, not resumed
    from titan_ulysses.planning import dry_run  # here: a launch imports this module, and needs no planner

    return dry_run.describe(config, world_size, dims, spec, _datasets(config), device_gib, record_note, device_name)


def _datasets(config: JobConfig) -> list[tuple[str, str, str]]:
    t, v = config.training, config.validation
    out = [("training", t.dataset, training_dataset_path(t))]
    if v.enable:
        out.append(("validation", v.dataset or t.dataset, v.dataset_path))
    return out
