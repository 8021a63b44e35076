"""The dry run's plan (``python train.py --config X --dry-run --world-size N``, ``preflight.plan``).

Once pre-flight has passed (``validate`` and ``check_files`` for ``N`` ranks), what a launch finds
out only later, returned as the plan's text (model, layout, data, memory by phase, what is saved where):

* the tokenizer, built as the trainer builds it, against the model's vocabulary;
* a data sample: the corpus files are listed and their first ``SAMPLE_ROWS`` rows read
  and tokenized as the token store would (SFT rows through the chat template), and a text
  corpus read on until it fills one window of ``training.seq_len`` (a launch refuses one that
  cannot); the corpus itself is tokenized at launch, not here (that can take hours);
* the memory estimate (``planning/estimate.py``) against the device memory: this
  machine's GPU, ``--device-memory-gib``, or on a machine without a GPU an 80 GiB H100
  (``DEFAULT_DEVICE_GIB``, as ``scripts/estimate_memory.py``). The dry run and the launch refuse a
  layout whose prediction (``planning/device_fit.py``: the estimate plus a measured cell's excess) exceeds
  the device, naming what fits (``planning/oom.py``). The plan says which GPUs (H100, H200) the
  estimate fits (``recommend.devices_that_fit``);
* the step time, tok/s and MFU the step-time model predicts on the device (``--device-name``, this
  machine's GPU, or the listed device nearest its memory: ``planning/rates.py``), and the fastest
  switches that fit it at this layout (``planning/fastest.py``).

The plan is for CUDA devices (a launch on a CPU machine also refuses attention backends
other than sdpa). Every refusal is a ``ConfigError`` or ``DataError`` of one line.
"""

from __future__ import annotations

import os

from titan_ulysses.checkpoint.manager import complete_steps
from titan_ulysses.checkpoint.weight_source import damaged_checkpoints, fresh_source
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, resolved_global_batch_size
from titan_ulysses.data.build import fewer_than_one_window
from titan_ulysses.data.datasets import PasskeyDataset
from titan_ulysses.interop.hf_datasets import hf_items, is_hf
from titan_ulysses.data.sources import DataError, list_files, read_rows, work_items
from titan_ulysses.distributed.heads import uneven_note
from titan_ulysses.models.registry import num_params
from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import GIB, from_config
from titan_ulysses.planning.recommend import devices_that_fit, memory_warning


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


def describe(config: JobConfig, world_size: int, dims, spec, datasets: list[tuple[str, str, str]],
             device_gib: float | None = None, note: str | None = None, device_name: str | None = None) -> str:
    """The plan of a config that passed the pre-flight, as text; a ConfigError / DataError for what only a launch
    would find (the memory beyond the device, a data sample the run would refuse). ``spec``: the run's
    (``run_spec.RunSpec``: model, tokenizer, overrides); ``datasets``: (name, kind, path) of each dataset the
    config names; ``note``: the start record's."""
    args, tokenizer = spec.args, spec.tokenizer_object
    lines = [f"dry run: {world_size} rank(s); nothing was started or written",
             f"model: {num_params(args) / 1e6:.1f}M params, {spec.source}; attention {config.model.attn_backend}; "
             f"{spec.tokenizer_line()}"]
    lines += _layout(config, dims, args)
    lines += [_data(config, tokenizer, kind, path, name)
              for name, kind, path in datasets]
    lines += _memory(config, dims, device_gib, args, device_name)
    lines += _saves(config)
    notes = [f"override: {o}" for o in spec.overrides] + [f"note: {n}" for n in (*spec.notes, note) if n]
    return "\n".join(lines + notes)


def _layout(config: JobConfig, dims, args) -> list[str]:
    t = config.training
    dp = dims.size("dp")
    gbs = resolved_global_batch_size(config, dp)
    seq_ranks = dims.sp * dims.cp
    lines = [f"layout: {dims.degrees}; each {t.seq_len}-token sequence over {seq_ranks} rank(s) "
             f"({t.seq_len // seq_ranks} tokens each); global batch {gbs} = local {t.local_batch_size} x dp {dp} "
             f"x {gbs // (t.local_batch_size * dp)} microbatch(es); {t.steps} steps of {gbs * t.seq_len} tokens"]
    if args.moe is not None:
        m = args.moe
        lines[-1] += f"; {m.num_experts} experts over ep {dims.ep} ({m.num_experts // dims.ep} per rank), top-{m.top_k}"
    note = uneven_note(args.n_heads, args.n_kv_heads, dims.sp, dims.tp)
    if note:
        lines.append(f"note: {note}")
    return lines


def _data(config: JobConfig, tokenizer, kind: str, path: str, name: str) -> str:
    """One line on a dataset, from its files and a tokenized sample of its first rows."""
    t = config.training
    if kind == "passkey":
        sample = PasskeyDataset(tokenizer, t.seq_len, t.seed, t.passkey_digits)[0]
        unread = f"; {name}.dataset_path {path!r} is not read" if path else ""  # said, not dropped silently
        return (f"{name} data: passkey (synthetic), {t.passkey_digits}-digit keys, sample 0 holds "
                f"{sample['input'].numel()} tokens{unread}")
    key = f"{name}.dataset_path"
    if is_hf(path):  # a `datasets` split (loaded, so downloaded unless offline)
        items, source = hf_items(path, key)
        what = f"{source['rows']} rows of a datasets split"
    else:
        files = list_files(path, key)
        items = work_items(files)
        what = f"{len(files)} file(s), {sum(os.path.getsize(f) for f in files) / 2**20:.1f} MiB"
    encode = _encoder(config, tokenizer, kind)
    lengths, window = [], _Window(t, kind)
    for where, row in (pair for item in items for pair in read_rows(item)):
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
    return (f"{name} data: {kind} {path}: {what}; first {len(lengths)} rows "
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


def _memory(config: JobConfig, dims, device_gib: float | None, args, device_name: str | None = None) -> list[str]:
    """The estimate by phase, the predicted peak and step time on the device, the fastest switches that fit it;
    a ConfigError naming what fits when the prediction exceeds the device."""
    from titan_ulysses.planning.fastest import fastest
    from titan_ulysses.planning.oom import launch_refusal
    from titan_ulysses.planning.rates import device_rates, kernel_of
    from titan_ulysses.planning.timing import step_time

    device, where = device_memory(device_gib)
    args, layout, switches = from_config(config, dims, args)
    t = config.training
    est = estimate(args, layout, switches, t.seq_len, t.local_batch_size)
    warning = memory_warning(config, dims, dims.world_size, device, args)
    if warning:
        raise ConfigError(warning)
    try:
        rates = device_rates(device_name or _this_gpu(), device / GIB)
    except ValueError as e:
        raise ConfigError(f"--device-name: {e}") from e
    refusal = launch_refusal(config, dims, device, args, rates.device)
    if refusal and not t.allow_over_memory_estimate:
        raise ConfigError(refusal)
    phases = ", ".join(f"{name} {b / GIB:.2f}" for name, b in est.phases.items())
    lines = [f"memory per device (estimate): {est.total / GIB:.2f} GiB at {est.peak_phase}, of {where}; "
             f"by phase (GiB): {phases}" + ("; experts' routing counted balanced" if args.moe is not None else ""),
             f"device memory needed (estimate): {devices_that_fit(est.total)}"]
    if est.host_offloaded:
        lines.append(f"host memory per rank (estimate): {est.host_offloaded / GIB:.2f} GiB (FSDP CPU offload's states, "
                     f"full_offload's block inputs)")
    fake, compiled = config.comm.mode == "fake", config.compile.enable
    precision, kernel = "float8" if config.float8.enable else "bf16", kernel_of(config.model.attn_backend)
    from titan_ulysses.planning.device_fit import predicted

    pred = predicted(args, layout, switches, t.seq_len, t.local_batch_size, compiled, rates.device)
    lines.append(f"predicted peak on an {rates.device}: {pred.total / GIB:.2f} GiB ({pred.note()})")
    time = step_time(args, layout, switches, t.seq_len, rates, t.local_batch_size, compiled, precision, kernel,
                     simulated=fake, link_gbs=config.comm.link_bandwidth_gbps or None)
    lines.append(f"step time (predicted, an {rates.device}, planning/timing.py): {time.total:.2f} s per microbatch, "
                 f"{time.tok_s:,.0f} tok/s per device, {time.mfu_pct:.1f}% MFU, {kernel} attention"
                 + ("; a simulated rank: no traffic" if fake else ""))
    best = fastest(args, layout, switches, t.seq_len, t.local_batch_size, rates, device, compiled, fake, precision,
                   kernel)
    lines.append("fastest that fits: " + (best.line() if best else f"nothing at this layout fits {where}"))
    return lines


def _this_gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


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
