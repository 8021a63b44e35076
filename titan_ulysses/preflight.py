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
the two above for ``N`` ranks, then what a launch finds out only later, returned as the
plan's text (model, layout, data, memory by phase, what is saved where):

* the tokenizer, built as the trainer builds it, against the model's vocabulary;
* the output folders (``job.dump_folder``, its ``tb`` folder) and, with W&B on, a login
  (``metrics/loggers/wandb_logger.py``'s ``login_problem``): a launch finds those out once started;
* a data sample: the corpus files are listed and their first ``SAMPLE_ROWS`` rows read
  and tokenized as the token store would (SFT rows through the chat template), and a text
  corpus read on until it fills one window of ``training.seq_len`` (a launch refuses one that
  cannot); the corpus itself is tokenized at launch, not here (that can take hours);
* the memory estimate (``metrics/memory_estimate.py``) against the device memory: this
  machine's GPU, ``--device-memory-gib``, or on a machine without a GPU an 80 GiB H100
  (``DEFAULT_DEVICE_GIB``, as ``scripts/estimate_memory.py``). A launch only warns when the
  estimate exceeds the device; the dry run refuses, naming the layout and switches that fit.

The plan is for CUDA devices (a launch on a CPU machine also refuses attention backends
other than sdpa). Every refusal is a ``ConfigError`` or ``DataError`` of one line.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.folders import output_folders_problem
from titan_ulysses.checkpoint.hf import check_hf_weights
from titan_ulysses.checkpoint.hf_export import check_dcp_model_shapes
from titan_ulysses.checkpoint.manager import complete_steps
from titan_ulysses.checkpoint.verify import ALL
from titan_ulysses.checkpoint.weight_source import (
    adopt_start_record,
    damaged_checkpoints,
    fresh_source,
    hf_weights_wanted,
)
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, check_config, check_requirements, resolved_global_batch_size
from titan_ulysses.data.build import check_dataset_files, fewer_than_one_window
from titan_ulysses.data.datasets import PasskeyDataset
from titan_ulysses.data.hf_tokenizer import hf_tokenizer_file
from titan_ulysses.data.sharding import check_seq_len
from titan_ulysses.data.sources import DataError, list_files, read_rows, work_items
from titan_ulysses.data.tokenizer import TokenizerError, resolve_tokenizer
from titan_ulysses.distributed.activation_checkpoint import check_layers_per_checkpoint
from titan_ulysses.distributed.float8 import check_float8, float8_options
from titan_ulysses.distributed.heads import uneven_note
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.staged_attention import check_head_stages
from titan_ulysses.distributed.ulysses import check_heads
from titan_ulysses.metrics.memory_estimate import GIB, estimate
from titan_ulysses.metrics.loggers.wandb_logger import login_problem
from titan_ulysses.metrics.memory_fit import from_config, memory_warning
from titan_ulysses.models.hf_config import describe
from titan_ulysses.models.registry import check_compute
from titan_ulysses.models.resolve import model_args
from titan_ulysses.ops.attention import check_attention_settings



def validate(config: JobConfig, world_size: int) -> ParallelDims:
    """Every setting's range and the cross-field checks that need only the world size (and the
    model's config.json); returns the ParallelDims to build.

    In ``comm.mode = "fake"`` the job must be one process and the layout is checked
    against ``comm.fake_world_size``.
    """
    p, t = config.parallelism, config.training
    world_size = check_config(config, world_size)
    try:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, sp=p.ulysses_degree, tp=p.tensor_parallel_degree,
            ep=p.expert_parallel_degree, world_size=world_size,
        )
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from e
    args = model_args(config)
    source = f"model.hf_assets_path {config.model.hf_assets_path!r}" if config.model.hf_assets_path else (
        f"model.flavor {config.model.flavor!r}")
    try:
        check_compute(args, config.model.attn_backend, config.model.sdpa_backends)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        check_heads(args.n_heads, args.n_kv_heads, dims.sp, dims.tp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"parallelism.ulysses_degree / tensor_parallel_degree: {e} ({source})") from e
    try:
        check_head_stages(p.ulysses_head_stages, args.n_heads, args.n_kv_heads, dims.sp, dims.tp)
    except ValueError as e:
        raise ConfigError(f"{e} ({source})") from e
    if p.ulysses_head_stages > 1 and (config.lora.rank > 0 or config.float8.enable):
        other = "lora.rank > 0" if config.lora.rank > 0 else "float8.enable"
        raise ConfigError(f"parallelism.ulysses_head_stages {p.ulysses_head_stages} with {other}: the staged "
                          f"attention slices plain nn.Linear projections per head group only; set "
                          f"parallelism.ulysses_head_stages 1")
    try:
        check_layers_per_checkpoint(config.activation_checkpoint.mode, config.activation_checkpoint.layers_per_checkpoint)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        check_seq_len(t.seq_len, dims.sp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"training.seq_len: {e}") from e
    try:  # what the backend cannot do (ops/attention/registry.py); the CPU check runs once the device is known
        check_attention_settings(config.model.attn_backend, config.model.sdpa_backends, dims.cp)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    dp = dims.size("dp")
    gbs = resolved_global_batch_size(config, dp)
    if gbs <= 0 or gbs % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size {gbs} must be a positive multiple of training.local_batch_size x dp = "
            f"{t.local_batch_size} x {dp} = {t.local_batch_size * dp}"
        )
    check_requirements(config)
    if config.float8.enable:
        try:
            check_float8(float8_options(config), dims.tp)
        except (ValueError, ImportError) as e:
            raise ConfigError(str(e)) from e
    return dims


def check_files(config: JobConfig) -> None:
    """Every file a setting names exists and fits the model: one line naming the setting, before any weight is read.

    Separate from ``validate`` (which tools such as estimate_memory run on machines without
    the data); the trainer runs both before any process group starts.
    """
    m, c = config.model, config.checkpoint
    args = model_args(config)
    if m.tokenizer == "tiktoken" and not os.path.isfile(m.tokenizer_path):
        raise ConfigError(f"model.tokenizer_path {m.tokenizer_path!r} is not a file (a Llama-3 tokenizer.model)")
    if m.tokenizer == "hf":
        try:
            hf_tokenizer_file(m.tokenizer_path or m.hf_assets_path)
        except FileNotFoundError as e:
            raise ConfigError(f"model.{'tokenizer_path' if m.tokenizer_path else 'hf_assets_path'}: {e}") from e
    # the file read whole (a broken tokenizer.json, no EOS, a garbage tiktoken file) and its ids
    # against the model's vocabulary, before any process group (issue 20)
    tokenizer = load_tokenizer(config)
    model_args(config, tokenizer.vocab_size)
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


def check_launch(config: JobConfig) -> tuple[ParallelDims, str | None]:
    """Every check a launch makes before it joins the process group, in the order that matters;
    returns the layout and the start record's note for the start-up line.

    The start checkpoint's record first (it may give the architecture), the dataset files before
    the layout (a layout error must not hide a missing file), then ``validate``, ``check_files``
    and the output folder.
    """
    note = adopt_start_record(config)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_dataset_files(config)
    dims = validate(config, world_size)
    check_files(config)
    problem = output_folders_problem(config)
    if problem:
        raise ConfigError(problem)
    return dims, note


def check_device(config: JobConfig, dims: ParallelDims, device) -> None:
    """The checks that need this rank's device, once it has joined the job: what the attention
    backend cannot do on it (refused), and on CUDA rank 0's warning when the memory estimate
    exceeds the device."""
    try:
        check_attention_settings(config.model.attn_backend, config.model.sdpa_backends, dims.cp, device.type)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if device.type == "cuda" and dist.get_rank() == 0:
        total = torch.cuda.get_device_properties(device).total_memory
        warning = memory_warning(config, dims, dist.get_world_size(), total)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)


DEFAULT_DEVICE_GIB = 80.0
"""Device memory assumed on a machine without a GPU: an H100 80GB (``--device-memory-gib`` sets it)."""
SAMPLE_ROWS = 8
"""Rows of each corpus read and tokenized by the dry run."""


def device_memory(gib: float | None) -> tuple[float, str]:
    """(bytes, where the figure comes from) of one device of the planned job."""
    if gib is not None:
        return gib * GIB, f"{gib:g} GiB (--device-memory-gib)"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.total_memory / GIB:.1f} GiB (this machine's {props.name})"
    return DEFAULT_DEVICE_GIB * GIB, (f"{DEFAULT_DEVICE_GIB:g} GiB (assumed: an H100; this machine has no GPU; "
                                      f"--device-memory-gib sets it)")


def load_tokenizer(config: JobConfig):
    """The run's tokenizer, as the trainer builds it; a file it cannot read is a ConfigError."""
    try:
        return resolve_tokenizer(config.model)
    except TokenizerError as e:
        raise ConfigError(str(e)) from e


def plan(config: JobConfig, world_size: int, device_gib: float | None = None) -> str:
    """Every pre-launch check for ``world_size`` ranks; the plan as text, or a ConfigError / DataError."""
    # as the trainer: the start checkpoint may give the architecture; verified whole here (one process)
    record_note = adopt_start_record(config, shards=ALL)
    dims = validate(config, world_size)
    check_files(config)
    # what a launch finds out only once started: the output folders, a W&B login (wandb.init)
    problem = output_folders_problem(config) or (login_problem() if config.metrics.enable_wandb else None)
    if problem:
        raise ConfigError(problem)
    tokenizer = load_tokenizer(config)
    args = model_args(config, tokenizer.vocab_size)
    m = config.model
    source = (f"{describe(args)} (from {m.hf_assets_path}/config.json)" if m.hf_assets_path
              else f"flavor {m.flavor}")
    lines = [f"dry run: {world_size} rank(s); nothing was started or written",
             f"model: {args.num_params() / 1e6:.1f}M params, {source}; attention {config.model.attn_backend}; "
             f"tokenizer {m.tokenizer} ({tokenizer.vocab_size} ids, model vocab {args.vocab_size})"]
    lines += _layout(config, dims, args)
    lines += [_data(config, tokenizer, kind, path, name)
              for name, kind, path in _datasets(config)]
    lines += _memory(config, dims, device_gib)
    lines += _saves(config)
    return "\n".join(lines + ([f"note: {record_note}"] if record_note else []))


def _layout(config: JobConfig, dims, args) -> list[str]:
    t = config.training
    dp = dims.size("dp")
    gbs = resolved_global_batch_size(config, dp)
    seq_ranks = dims.sp * dims.cp
    lines = [f"layout: {dims.degrees}; each {t.seq_len}-token sequence over {seq_ranks} rank(s) "
             f"({t.seq_len // seq_ranks} tokens each); global batch {gbs} = local {t.local_batch_size} x dp {dp} "
             f"x {gbs // (t.local_batch_size * dp)} microbatch(es); {t.steps} steps of {gbs * t.seq_len} tokens"]
    note = uneven_note(args.n_heads, args.n_kv_heads, dims.sp, dims.tp)
    if note:
        lines.append(f"note: {note}")
    return lines


def _datasets(config: JobConfig) -> list[tuple[str, str, str]]:
    t, v = config.training, config.validation
    out = [("training", t.dataset, t.dataset_path)]
    if v.enable:
        out.append(("validation", v.dataset or t.dataset, v.dataset_path))
    return out


def _data(config: JobConfig, tokenizer, kind: str, path: str, name: str) -> str:
    """One line on a dataset, from its files and a tokenized sample of its first rows."""
    t = config.training
    if kind == "passkey":
        sample = PasskeyDataset(tokenizer, t.seq_len, t.seed, t.passkey_digits)[0]
        return (f"{name} data: passkey (synthetic), {t.passkey_digits}-digit keys, sample 0 holds "
                f"{sample['input'].numel()} tokens")
    key = f"{name}.dataset_path"
    files = list_files(path, key)
    size = sum(os.path.getsize(f) for f in files)
    encode = _encoder(config, tokenizer, kind)
    lengths, window = [], _Window(t, kind)
    for where, row in (pair for item in work_items(files) for pair in read_rows(item)):
        ids, _ = encode(where, row)
        if len(lengths) < SAMPLE_ROWS:
            if kind == "sft" and len(ids) > t.seq_len and t.overlong_samples == "error":
                raise DataError(f"{where}: an SFT sample of {len(ids)} tokens is longer than training.seq_len "
                                f"{t.seq_len}; set training.overlong_samples to 'truncate' or 'drop'")
            lengths.append(len(ids))
        if window.add(len(ids)) and len(lengths) == SAMPLE_ROWS:
            break
    if not lengths:
        raise DataError(f"{key} {path!r} holds no documents (empty file?)")
    if not window.filled():
        raise DataError(fewer_than_one_window(path, window.tokens, t))
    rows = "packed into windows with document masks" if t.packing else "one per window"
    return (f"{name} data: {kind} {path}: {len(files)} file(s), {size / 2**20:.1f} MiB; first {len(lengths)} rows "
            f"tokenize to {sum(lengths)} tokens (longest {max(lengths)}), {rows} of {t.seq_len}; "
            f"the corpus is tokenized at launch into {t.dataset_cache_dir or 'a .titan_cache folder beside it'}")


class _Window:
    """Whether the rows read so far fill one window, as the launch's text datasets count (``data/windows.py``):
    ``seq_len`` tokens of kept documents when packing, else one kept document. SFT has refusals of its own."""

    def __init__(self, training, kind: str):
        self.t, self.kind, self.tokens, self.kept, self.docs = training, kind, 0, 0, 0

    def add(self, n: int) -> bool:
        self.tokens += n
        if n >= self.t.min_document_tokens:
            self.kept, self.docs = self.kept + n, self.docs + 1
        return self.filled()

    def filled(self) -> bool:
        return self.kind != "text" or (self.kept >= self.t.seq_len if self.t.packing else self.docs > 0)


def _encoder(config: JobConfig, tokenizer, kind: str):
    from titan_ulysses.data.encode import SFTEncoder, TextEncoder

    if kind == "sft":
        from titan_ulysses.data.chat import load_chat_template

        return SFTEncoder(tokenizer, load_chat_template(config.training.chat_template, tokenizer))
    return TextEncoder(tokenizer)


def _memory(config: JobConfig, dims, device_gib: float | None) -> list[str]:
    """The estimate by phase; a ConfigError naming what fits when it exceeds the device."""
    device, where = device_memory(device_gib)
    args, layout, switches = from_config(config, dims)
    t = config.training
    est = estimate(args, layout, switches, t.seq_len, t.local_batch_size)
    warning = memory_warning(config, dims, dims.world_size, device)
    if warning:
        raise ConfigError(warning)
    phases = ", ".join(f"{name} {b / GIB:.2f}" for name, b in est.phases.items())
    return [f"memory per device (estimate): {est.total / GIB:.2f} GiB at {est.peak_phase}, of {where}; "
            f"by phase (GiB): {phases}"]


def _saves(config: JobConfig) -> list[str]:
    """Where metrics and checkpoints go, and where the weights of the first step come from."""
    c, t, dump = config.checkpoint, config.training, config.job.dump_folder
    lines = [f"metrics: {os.path.join(dump, 'metrics.jsonl')}"
             + (f", tensorboard {os.path.join(dump, 'tb')}" if config.metrics.enable_tensorboard else "")]
    folder = os.path.join(dump, c.folder)
    steps = complete_steps(folder) if c.enable else []
    if c.enable:
        keep = f"the newest {c.keep_latest_k}" if c.keep_latest_k else "all"
        lines.append(f"checkpoints: {folder}/step-N every {c.interval} steps and at step {t.steps} "
                     f"(async_mode {c.async_mode}; keeping {keep})")
    else:
        lines.append("checkpoints: none (checkpoint.enable false)")
    if steps and steps[-1] >= t.steps:
        weights = f"none: {folder}/step-{steps[-1]} already reached training.steps {t.steps}; nothing to train"
    elif steps:
        weights = f"resumes from {folder}/step-{steps[-1]} (if it verifies; else the newest that does)"
    elif c.enable and damaged_checkpoints(folder) and not c.allow_fresh_start:
        weights = (f"none: every checkpoint in {folder} is damaged ({', '.join(damaged_checkpoints(folder))}); the "
                   f"run will stop (checkpoint.allow_fresh_start true starts over from {fresh_source(config).describe()})")
    else:  # checkpoint/weight_source.py decides the same way at launch
        weights = fresh_source(config).describe()
    lines.append(f"weights at the first step: {weights}")
    return lines
