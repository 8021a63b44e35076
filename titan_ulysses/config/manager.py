"""Load a TOML file, apply ``--section.key value`` overrides, validate before any process group work."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from titan_ulysses.checkpoint.hf import check_hf_weights
from titan_ulysses.checkpoint.hf_export import check_dcp_model_shapes
from titan_ulysses.config.job_config import CHOICES, JobConfig
from titan_ulysses.data.hf_tokenizer import hf_tokenizer_file
from titan_ulysses.config.ranges import check_ranges
from titan_ulysses.data.sharding import check_seq_len
from titan_ulysses.distributed.float8 import Float8Options, check_float8
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.staged_attention import check_head_stages
from titan_ulysses.distributed.ulysses import check_heads
from titan_ulysses.models.hf_config import load_hf_args
from titan_ulysses.models.llama.args import get_flavor
from titan_ulysses.ops.attention import parse_sdpa_backends


class ConfigError(ValueError):
    """A setting is wrong; the message names it as section.key and says what to do."""


def _fields(obj) -> dict[str, type]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _all_keys(config: JobConfig) -> list[str]:
    return [f"{s}.{k}" for s in _fields(config) for k in _fields(getattr(config, s))]


def _unknown(key: str, config: JobConfig) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(config), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid sections: {', '.join(_fields(config))}"
    return ConfigError(f"unknown key '{key}'{hint}")


def _convert(key: str, value, kind: type):
    """``value`` (a TOML value or a command-line string) as ``kind``, or a ConfigError."""
    from_cli = isinstance(value, str) and kind is not str
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if from_cli and value.lower() in ("true", "false"):
                return value.lower() == "true"
        elif kind is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_cli:
                return int(value)
        elif kind is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if from_cli:
                return float(value)
        elif kind is str and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise ConfigError(f"{key} expects {kind.__name__}{' (true or false)' if kind is bool else ''}, got {value!r}")


def _set(config: JobConfig, key: str, value) -> None:
    section, _, name = key.partition(".")
    if section not in _fields(config) or not name:
        raise _unknown(key, config)
    obj = getattr(config, section)
    kinds = _fields(obj)
    if name not in kinds:
        raise _unknown(key, config)
    value = _convert(key, value, kinds[name])
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key} {value!r} is not one of {list(CHOICES[key])}")
    setattr(obj, name, value)


def load_config(argv: list[str]) -> JobConfig:
    """``[--config file.toml] [--section.key value | --section.key=value ...]`` -> JobConfig."""
    config = JobConfig()
    pairs, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; use --config FILE and --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            value, i = argv[i + 1], i + 1
        if key == "config":
            path = value
        else:
            pairs.append((key, value))
        i += 1
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read the file ({e.strerror})") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {path}: not valid TOML ({e})") from e
        for section, values in data.items():
            if not isinstance(values, dict):
                raise _unknown(section, config)
            for name, value in values.items():
                _set(config, f"{section}.{name}", value)
    for key, value in pairs:  # the command line wins over the file
        _set(config, key, value)
    return config


def resolved_global_batch_size(config: JobConfig, dp: int) -> int:
    t = config.training
    return t.local_batch_size * dp if t.global_batch_size == -1 else t.global_batch_size


def validate(config: JobConfig, world_size: int) -> ParallelDims:
    """Every setting's range (``config/ranges.py``), then the cross-field checks that need only
    the world size; returns the ParallelDims to build.

    In ``comm.mode = "fake"`` the job must be one process and the layout is checked
    against ``comm.fake_world_size``.
    """
    p, t = config.parallelism, config.training
    refusal = check_ranges(config)
    if refusal:
        raise ConfigError(refusal)
    if config.comm.mode == "fake":
        if world_size != 1:
            raise ConfigError(f"comm.mode 'fake' simulates a job in one process; launch 1 process, not {world_size}")
        if config.checkpoint.enable:
            raise ConfigError("checkpoint.enable must be false with comm.mode 'fake' (its weights are not real)")
        if config.checkpoint.initial_load_in_hf:
            raise ConfigError("checkpoint.initial_load_in_hf must be false with comm.mode 'fake' (a fake process "
                              "group cannot load real weights; the architecture still comes from model.hf_assets_path)")
        world_size = config.comm.fake_world_size
    try:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, sp=p.ulysses_degree, tp=p.tensor_parallel_degree, world_size=world_size,
        )
    except ValueError as e:
        raise ConfigError(f"parallelism: {e}") from e
    args = _model_args(config)
    source = f"model.hf_assets_path {config.model.hf_assets_path!r}" if config.model.hf_assets_path else (
        f"model.flavor {config.model.flavor!r}")
    try:
        check_heads(args.n_heads, args.n_kv_heads, dims.sp, dims.tp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"parallelism.ulysses_degree / tensor_parallel_degree: {e} ({source})") from e
    try:
        check_head_stages(p.ulysses_head_stages, args.n_heads, args.n_kv_heads, dims.sp, dims.tp)
    except ValueError as e:
        raise ConfigError(f"{e} ({source})") from e
    try:
        check_seq_len(t.seq_len, dims.sp, dims.cp)
    except ValueError as e:
        raise ConfigError(f"training.seq_len: {e}") from e
    try:
        parse_sdpa_backends(config.model.sdpa_backends)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if dims.cp > 1 and config.model.attn_backend != "sdpa":
        raise ConfigError(
            f"parallelism.context_parallel_degree {dims.cp} is implemented for model.attn_backend 'sdpa' only, "
            f"not {config.model.attn_backend!r}; use 'sdpa' (or context_parallel_degree 1)"
        )
    dp = dims.size("dp")
    gbs = resolved_global_batch_size(config, dp)
    if gbs <= 0 or gbs % (t.local_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size {gbs} must be a positive multiple of training.local_batch_size x dp = "
            f"{t.local_batch_size} x {dp} = {t.local_batch_size * dp}"
        )
    _validate_data(config, dims)
    if config.model.tokenizer == "tiktoken" and not config.model.tokenizer_path:
        raise ConfigError("model.tokenizer 'tiktoken' needs model.tokenizer_path (a Llama-3 tokenizer.model file)")
    m, c = config.model, config.checkpoint
    if m.tokenizer == "hf" and not (m.tokenizer_path or m.hf_assets_path):
        raise ConfigError("model.tokenizer 'hf' needs model.hf_assets_path (or model.tokenizer_path): the folder "
                          "with tokenizer.json")
    if c.initial_load_in_hf and not m.hf_assets_path:
        raise ConfigError("checkpoint.initial_load_in_hf needs model.hf_assets_path (the folder whose weights "
                          "the run starts from)")
    if c.initial_load_in_hf and c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_in_hf and checkpoint.initial_load_path both name the start "
                          "weights; set one")
    if t.dataset == "text" and not t.dataset_path:
        raise ConfigError("training.dataset 'text' needs training.dataset_path (a file or a folder of .txt/.jsonl/.parquet)")
    if config.float8.enable:
        try:
            check_float8(float8_options(config), dims.tp)
        except (ValueError, ImportError) as e:
            raise ConfigError(str(e)) from e
    return dims


def _model_args(config: JobConfig):
    """The model's architecture (from model.flavor, or from the config.json of model.hf_assets_path)."""
    path = config.model.hf_assets_path
    if not path:
        try:
            return get_flavor(config.model.flavor)
        except ValueError as e:
            raise ConfigError(f"model.flavor: {e}") from e
    try:
        return load_hf_args(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf_assets_path: {e}") from e


def check_files(config: JobConfig) -> None:
    """Every file a setting names exists and fits the model: one line naming the setting, before any weight is read.

    Separate from ``validate`` (which tools such as estimate_memory run on machines without
    the data); the trainer runs both before any process group starts.
    """
    m, c = config.model, config.checkpoint
    args = _model_args(config)
    if m.tokenizer == "tiktoken" and not os.path.isfile(m.tokenizer_path):
        raise ConfigError(f"model.tokenizer_path {m.tokenizer_path!r} is not a file (a Llama-3 tokenizer.model)")
    if m.tokenizer == "hf":
        try:
            hf_tokenizer_file(m.tokenizer_path or m.hf_assets_path)
        except FileNotFoundError as e:
            raise ConfigError(f"model.{'tokenizer_path' if m.tokenizer_path else 'hf_assets_path'}: {e}") from e
    if c.initial_load_in_hf:
        try:
            check_hf_weights(m.hf_assets_path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_in_hf: model.hf_assets_path {m.hf_assets_path!r}: {e}") from e
    if c.initial_load_path:
        try:
            check_dcp_model_shapes(c.initial_load_path, args)
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint.initial_load_path: {e}") from e


# sdpa masks packed documents with a dense [B, 1, S, S] boolean mask; above this many
# elements (1 GiB, with about twice that in temporaries) it is refused in favour of flex.
SDPA_DENSE_MASK_MAX_ELEMENTS = 2**30


def _check_path(key: str, path: str, kind: str) -> None:
    if kind == "passkey":
        return
    if not path:  # a path that does not exist is the data builder's one-line DataError
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.dataset {kind!r} needs {key} "
                          f"(a file or a folder of {'.txt/' if kind == 'text' else ''}.jsonl/.parquet)")


def _validate_data(config: JobConfig, dims: ParallelDims) -> None:
    t, v = config.training, config.validation
    _check_path("training.dataset_path", t.dataset_path, t.dataset)
    if v.enable:
        _check_path("validation.dataset_path", v.dataset_path, v.dataset or t.dataset)
    kinds = {t.dataset} | ({v.dataset or t.dataset} if v.enable else set())
    packed = t.packing and bool(kinds - {"passkey"})
    if packed and config.model.attn_backend == "sdpa":
        from titan_ulysses.data.sharding import padded_length

        s = padded_length(t.seq_len, dims.sp)
        if t.local_batch_size * s * s > SDPA_DENSE_MASK_MAX_ELEMENTS:
            gib = t.local_batch_size * s * s / 2**30
            raise ConfigError(
                f"packed documents on model.attn_backend 'sdpa' need a dense [{t.local_batch_size}, 1, {s}, {s}] "
                f"document mask ({gib:.0f} GiB) at training.seq_len {t.seq_len}; use model.attn_backend 'flex' "
                f"or 'flash_attn', or training.packing = false (one document per window)"
            )


def float8_options(config: JobConfig) -> Float8Options | None:
    """The float8 settings of ``config`` for ``parallelize_llama``; None when float8 is off."""
    f = config.float8
    if not f.enable:
        return None
    return Float8Options(recipe=f.recipe, emulate=f.emulate, fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather)


def to_dict(config: JobConfig) -> dict:
    return dataclasses.asdict(config)
