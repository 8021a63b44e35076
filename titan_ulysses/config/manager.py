"""Load a TOML file, apply ``--section.key value`` overrides, validate before any process group work."""

from __future__ import annotations

import dataclasses
import difflib
import typing

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

from titan_ulysses.config.job_config import CHOICES, JobConfig, LoRA, parse_lora_targets
from titan_ulysses.config.metrics_settings import check_metrics
from titan_ulysses.config.profiling import check_profiling
from titan_ulysses.config.ranges import check_ranges
from titan_ulysses.config.shipped import config_path, not_found


class ConfigError(ValueError):
    """A setting is wrong; the message names it as section.key and says what to do."""


def _fields(obj) -> dict[str, type]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _all_keys(config: JobConfig) -> list[str]:
    keys = []
    for s in _fields(config):
        obj = getattr(config, s)
        for k in _fields(obj):
            inner = getattr(obj, k)  # a table inside a section: [training.hf_dataset]
            keys += [f"{s}.{k}.{n}" for n in _fields(inner)] if dataclasses.is_dataclass(inner) else [f"{s}.{k}"]
    return keys


def _unknown(key: str, config: JobConfig) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(config), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid sections: {', '.join(_fields(config))}"
    return ConfigError(f"unknown key '{key}'{hint}")


def _convert(key: str, value, kind: type, from_cli: bool = False, where: str = ""):
    """``value`` as ``kind``, or a ConfigError. Command-line values are strings and are converted;
    a TOML file has types of its own, so a quoted number there (``steps = "10"``) is refused."""
    from_cli = from_cli and isinstance(value, str) and kind is not str
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
    hint = ""
    if isinstance(value, str) and kind is not str and where:
        name = key.split(".", 1)[1]
        what, example = {bool: ("true or false", "true"), int: ("a whole number", "2"),
                         float: ("a number", "0.5")}.get(kind, (kind.__name__, "..."))
        try:  # drop the quotes only where the bare value is one: `ulysses_degree = many` is no number either
            _convert(key, value, kind, from_cli=True)
            hint = f" (a string in {where}: write {name} = {value} without quotes)"
        except ConfigError:
            hint = f" (a string in {where}: write {what} without quotes, e.g. {name} = {example})"
    raise ConfigError(f"{key} expects {kind.__name__}{' (true or false)' if kind is bool else ''}, got {value!r}{hint}")


def _set(config: JobConfig, key: str, value, from_cli: bool = False, where: str = "") -> None:
    section, _, name = key.partition(".")
    if section not in _fields(config) or not name:
        raise _unknown(key, config)
    obj = getattr(config, section)
    while "." in name:  # a key of a table inside the section: --training.hf_dataset.name
        head, _, name = name.partition(".")
        if head not in _fields(obj) or not dataclasses.is_dataclass(getattr(obj, head)):
            raise _unknown(key, config)
        obj = getattr(obj, head)
    kinds = _fields(obj)
    if name not in kinds:
        raise _unknown(key, config)
    if dataclasses.is_dataclass(getattr(obj, name)):  # [training.hf_dataset] in a TOML file
        if not isinstance(value, dict):
            raise ConfigError(f"{key} is a table: write [{key}] with its keys, or --{key}.KEY value")
        for inner, inner_value in value.items():
            _set(config, f"{key}.{inner}", inner_value, from_cli, where)
        return
    kind = kinds[name]
    if type(None) in typing.get_args(kind):  # `bool | None`: unset by default, a value when given
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    value = _convert(key, value, kind, from_cli, where)
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"{key} {value!r} is not one of {list(CHOICES[key])}")
    setattr(obj, name, value)


def load_config(argv: list[str]) -> JobConfig:
    """``[--config file.toml | NAME] [--section.key value | --section.key=value ...]`` -> JobConfig (NAME: a
    shipped config, ``config/shipped.py``)."""
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
        found = config_path(path)
        if found is None:
            raise ConfigError(not_found(path))
        path = found
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read the file ({e.strerror})") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config {path}: not valid TOML ({e})") from e
        except UnicodeDecodeError as e:  # a binary file: tomllib decodes before it parses
            raise ConfigError(f"--config {path}: not a TOML text file (byte {e.start} is not UTF-8); name a .toml "
                              f"config") from e
        for section, values in data.items():
            if not isinstance(values, dict):
                raise _unknown(section, config)
            for name, value in values.items():
                _set(config, f"{section}.{name}", value, where=path)
    for key, value in pairs:  # the command line wins over the file
        _set(config, key, value, from_cli=True)
    return config


def resolved_global_batch_size(config: JobConfig, dp: int) -> int:
    t = config.training
    return t.local_batch_size * dp if t.global_batch_size == -1 else t.global_batch_size


def check_config(config: JobConfig, world_size: int) -> int:
    """Every setting's range (``config/ranges.py``), then the cross-field checks that need nothing
    but the config itself; returns the world size the layout is to be checked against.

    In ``comm.mode = "fake"`` the job must be one process and the layout is checked
    against ``comm.fake_world_size``. The checks that need the model, the parallelism
    layout, this machine or the files a setting names are ``titan_ulysses/preflight.py``'s.
    """
    refusal = check_ranges(config) or check_metrics(config.metrics) or check_profiling(config.profiling)
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
    _check_lora(config)
    return world_size


def _check_lora(config: JobConfig) -> None:
    """lora.target_modules names (always: a typo should not wait for rank > 0) and what LoRA does not compose with."""
    lora, tp = config.lora, config.parallelism.tensor_parallel_degree
    try:
        targets = parse_lora_targets(lora.target_modules)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if lora.rank == 0:  # off: a full fine-tune, which the other [lora] settings would silently not describe
        default = LoRA()
        given = [f"lora.{name} {getattr(lora, name)!r}" for name in ("alpha", "dropout") if getattr(lora, name)
                 != getattr(default, name)]
        if targets != parse_lora_targets(default.target_modules):
            given.append(f"lora.target_modules {lora.target_modules!r}")
        if given:
            raise ConfigError(f"lora.rank 0 turns LoRA off (a full fine-tune of every weight), yet {', '.join(given)} "
                              f"{'is' if len(given) == 1 else 'are'} set; set lora.rank > 0 to train adapters, or "
                              f"remove the other [lora] settings for a full fine-tune")
    mlp = [t for t in targets if t in ("gate_proj", "up_proj", "down_proj")]
    if lora.rank > 0 and lora.dropout > 0 and config.model.mlp_tile_size > 0 and mlp:
        raise ConfigError(
            f"lora.dropout {lora.dropout} with model.mlp_tile_size {config.model.mlp_tile_size}: the tiled MLP "
            f"recomputes each tile in backward, where the adapters of {', '.join(mlp)} would draw other dropout "
            f"masks; set lora.dropout 0, model.mlp_tile_size 0, or leave the MLP out of lora.target_modules"
        )
    if lora.rank > 0 and tp > 1:
        raise ConfigError(
            f"lora.rank {lora.rank} with parallelism.tensor_parallel_degree {tp} is not supported: "
            f"tensor parallelism shards only the base projections, the adapters would need plans of their own; "
            f"use ulysses_degree / context_parallel_degree / data_parallel_shard_degree (tensor_parallel_degree 1)"
        )


def check_requirements(config: JobConfig) -> None:
    """The settings that another setting requires (a dataset kind its path, a tokenizer its file, ...)."""
    t, v = config.training, config.validation
    _check_hf_dataset(t)
    if not t.hf_dataset.name:
        _check_path("training.dataset_path", t.dataset_path, t.dataset)
    if v.enable:
        _check_path("validation.dataset_path", v.dataset_path, v.dataset or t.dataset)
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
    if t.dataset == "text" and not (t.dataset_path or t.hf_dataset.name):
        raise ConfigError("training.dataset 'text' needs training.dataset_path (a file or a folder of .txt/.jsonl/.parquet)")


def _check_hf_dataset(t) -> None:
    """[training.hf_dataset]: its name with a text/sft dataset, not beside training.dataset_path, no streaming."""
    table, default = t.hf_dataset, type(t.hf_dataset)()
    if table.streaming:
        raise ConfigError("training.hf_dataset.streaming true is not supported: the token store tokenizes every row "
                          "once before the first step, so that every layout reads the same global order; set it false")
    if not table.name:
        changed = [f.name for f in dataclasses.fields(table) if getattr(table, f.name) != getattr(default, f.name)]
        if changed:
            raise ConfigError(f"training.hf_dataset.{changed[0]} is set but training.hf_dataset.name is not; name the "
                              f"dataset (a `datasets` name or folder)")
        return
    if t.dataset_path:
        raise ConfigError(f"training.hf_dataset.name {table.name!r} and training.dataset_path {t.dataset_path!r} both "
                          f"name the training data; set one")
    if t.dataset == "passkey":
        raise ConfigError(f"training.hf_dataset.name {table.name!r} is set but training.dataset is 'passkey' "
                          f"(synthetic); set training.dataset to 'text' or 'sft'")


def _check_path(key: str, path: str, kind: str) -> None:
    if kind == "passkey":  # a path beside it is not read: said at start-up and in the dry run (unread_dataset_path)
        return
    if not path:  # a path that does not exist is the data builder's one-line DataError
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.dataset {kind!r} needs {key} "
                          f"(a file or a folder of {'.txt/' if kind == 'text' else ''}.jsonl/.parquet)")


def unread_dataset_path(config: JobConfig) -> str | None:
    """The note for a ``dataset_path`` that the synthetic passkey dataset does not read (a shipped config's
    ``./data`` under ``--training.dataset passkey``, the documented way to try a config without data), or None.
    Said at start-up and in the dry run: it was dropped silently (issue 43)."""
    t, v = config.training, config.validation
    unread = [(f"{name}.dataset_path", path) for name, kind, path, on in (
        ("training", t.dataset, t.dataset_path, True), ("validation", v.dataset or t.dataset, v.dataset_path, v.enable))
        if on and kind == "passkey" and path]
    if not unread:
        return None
    return (f"the passkey dataset is synthetic: {', '.join(f'{k} {p!r}' for k, p in unread)} is not read (set "
            f"training.dataset to 'text' or 'sft' to train on it)")


def to_dict(config: JobConfig) -> dict:
    return dataclasses.asdict(config)
