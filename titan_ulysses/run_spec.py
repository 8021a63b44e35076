"""What a run is, resolved once: ``resolve_run(config) -> RunSpec``.

Train, ``--dry-run``, export, ``eval_needle``, ``eval_long``, ``plan.py`` and ``estimate_memory.py``
all take the model arguments, the tokenizer, the weight source and the data settings from here; no
other module reads a checkpoint's ``model_args.json`` or a folder's ``config.json`` to decide them.

The rule (docs/run_spec.md), in one place:

1. The inputs: the config (TOML, then ``--section.key`` flags), the record of the start checkpoint
   (``checkpoint.initial_load_path``, or the checkpoint a tool evaluates or exports: its
   ``model_args.json`` and ``hf_assets/``) and the Hugging Face folder (``model.hf_assets_path``,
   else the record's ``hf_assets/``).
2. The model arguments are the record's when there is one, else the folder's config.json, else
   ``model.flavor``'s. Without a record the config's RoPE settings apply to them.
3. What was recorded wins unless the user overrides it. The config's RoPE settings are 0 / "" ("keep
   the model's") unless given, so a default never erases a recorded scaling; a RoPE setting given
   (``model.rope_theta``, ``model.rope_scaling_factor``: context extension of a checkpoint) is an
   override, and one that changes a recorded value is named on the start-up line (``RunSpec.overrides``);
   so are another lora.alpha over a LoRA start and another tokenizer than the record's. A LoRA start's rank
   and targets are the run's or refused (its adapters would be dropped or not fit).
   A resume is the same run going on: there a changed model setting is refused unless
   ``checkpoint.override_recorded`` lists it, and named when it does (``config/resume.py``).
4. The tokenizer: ``model.tokenizer``; unset, the folder's tokenizer.json when it has one, else the
   byte tokenizer. Ids beyond the model's vocabulary, or pretrained weights (a Hugging Face folder's
   safetensors, a checkpoint of a run from one) and a tokenizer with fewer than half the ids of their
   vocabulary, are a one-line refusal (an architecture alone, randomly initialised, takes any tokenizer).
5. The weights: ``checkpoint/weight_source.py``'s order; the data settings: the config's.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from titan_ulysses.interop.hf_export import ASSETS, read_data_settings, read_model_record, record_hint
from titan_ulysses.interop.peft_export import read_lora_record
from titan_ulysses.interop.hub import resolve_hf_assets
from titan_ulysses.checkpoint.weight_source import WeightSource, fresh_source
from titan_ulysses.config.job_config import JobConfig, parse_lora_targets
from titan_ulysses.config.manager import ConfigError
from titan_ulysses.config.resume import overrides as override_list
from titan_ulysses.data.tokenizer import TokenizerError, resolve_tokenizer, tokenizer_source
from titan_ulysses.models.decoder.args import DecoderArgs
from titan_ulysses.models.flavors import TRAINED_SEQ_LEN, get_flavor
from titan_ulysses.interop.hf_config import describe, load_hf_args, read_hf_config
from titan_ulysses.models.resolve import apply_model_settings


@dataclass(frozen=True)
class RunSpec:
    args: DecoderArgs
    """The model's arguments: family, shapes, RoPE and its scaling."""
    source: str
    """Where ``args`` come from, for the start-up line."""
    hf_folder: str
    """The Hugging Face folder the run reads (config, tokenizer, weights), "" for none."""
    record: str
    """The checkpoint whose ``model_args.json`` gave ``args`` ("" : none)."""
    tokenizer: str
    """"byte", "tiktoken" or "hf"."""
    tokenizer_path: str
    tokenizer_vocab: int
    """The tokenizer's ids (0: not built, ``resolve_run(..., tokenizer=False)``)."""
    weights: WeightSource
    """Where a fresh start's weights come from (a resume's own checkpoint wins at the load)."""
    seq_len: int
    dataset: str
    dataset_path: str
    overrides: tuple[str, ...] = ()
    """Each ``checkpoint.override_recorded`` setting that changed a recorded value: ``key recorded -> new``."""
    notes: tuple[str, ...] = ()
    tokenizer_object: object = field(default=None, compare=False, repr=False)
    model: "ResolvedModel | None" = field(default=None, compare=False, repr=False)
    """The model resolved once, with where its arguments came from (``args`` is ``model.args``)."""

    def tokenizer_line(self) -> str:
        """``tokenizer KIND [FILE] (N ids, model vocab V)``: the start-up line's and the dry run's."""
        where = f" {self.tokenizer_path}" if self.tokenizer_path else ""
        ids = f"{self.tokenizer_vocab} ids" if self.tokenizer_vocab else "not read"
        return f"tokenizer {self.tokenizer}{where} ({ids}, model vocab {self.args.vocab_size})"


def hf_folder(config: JobConfig, record_dir: str = "") -> str:
    """The Hugging Face folder of the run: the first and only place ``model.hf_assets_path`` is read
    (a Hub id becomes a local snapshot folder here); else a start checkpoint's ``hf_assets/``.
    Writes the folder back to ``config.model.hf_assets_path`` so that every later reader sees it."""
    resolve_hf_assets(config)  # a Hub id -> its snapshot folder (interop/hub.py); a folder stays as it is
    folder = config.model.hf_assets_path
    if not folder and record_dir and os.path.isfile(os.path.join(record_dir, ASSETS, "config.json")):
        folder = os.path.join(record_dir, ASSETS)
    config.model.hf_assets_path = folder
    return folder


def _is_checkpoint(path: str) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, ".metadata"))


_SCALING = ("rope_scaling_factor", "rope_scaling_type", "rope_original_max_position_embeddings")
_SHAPES = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_dim", "vocab_size")


@dataclass(frozen=True)
class ResolvedModel:
    """The model's arguments, resolved once (``models/resolve.apply_model_settings`` called once), with where
    each came from; every later check compares these values and never resolves again."""

    args: DecoderArgs
    """The run's model: ``base`` with the config's model settings applied."""
    base: DecoderArgs
    """Before the config's settings: the start record's arguments, else the folder's config.json, else the flavor."""
    base_from: str
    """The setting ``base`` comes from, for a refusal: ``the record of DIR``, ``model.hf_assets_path``, ``model.flavor 'X'``."""
    named: DecoderArgs
    """The model the config names (its folder's, else its flavor's), before its settings; ``base`` without a record."""
    record: str = ""
    """The checkpoint whose ``model_args.json`` gave ``base`` ("": none)."""
    pretrained: bool = False
    """The record is of a run from a Hugging Face model: its vocabulary is a pretrained one."""

    def origin(self, name: str) -> str:
        """Where argument ``name`` came from: ``base_from``, or the config's model settings when they changed it."""
        return "the config's model settings" if getattr(self.args, name) != getattr(self.base, name) else self.base_from


def _named_model(config: JobConfig, folder: str) -> DecoderArgs:
    """The model the config names, before its RoPE settings: the folder's config.json, else the flavor."""
    try:
        return load_hf_args(folder) if folder else get_flavor(config.model.flavor)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.{'hf_assets_path' if folder else 'flavor'}: {e}") from e


def resolve_model(config: JobConfig, start: str) -> ResolvedModel:
    """The model's arguments by the rule above (2 and 3), resolved once; ConfigError naming the setting."""
    m = config.model
    record = read_model_record(start) if _is_checkpoint(start) else None
    folder = hf_folder(config, start if record is not None else "")
    named = _named_model(config, folder)
    if record is None:
        source = "model.hf_assets_path" if folder else f"model.flavor {m.flavor!r}"
        max_positions = (read_hf_config(folder).get("max_position_embeddings", 0) if folder
                         else TRAINED_SEQ_LEN.get(m.flavor, 0))  # a debug flavor's 512, not llama3's 8192
        return ResolvedModel(apply_model_settings(named, m, max_positions, source), named, source, named)
    recorded, hf_config = record
    _same_model(named, recorded, config, start)
    # the length the model was trained at: its config.json's, else its flavor's (models/flavors.py)
    max_positions = (hf_config or {}).get("max_position_embeddings", 0) if hf_config else TRAINED_SEQ_LEN.get(m.flavor, 0)
    source = f"the record of {start}"
    return ResolvedModel(apply_model_settings(recorded, m, max_positions, source), recorded, source, named,
                         record=start, pretrained=hf_config is not None)


def _same_model(named: DecoderArgs, recorded: DecoderArgs, config: JobConfig, start: str) -> None:
    """The model the config names has the shapes ``start`` records: a ConfigError naming the setting that
    gives the recorded one otherwise."""
    differ = [f for f in _SHAPES if getattr(named, f, None) != getattr(recorded, f, None)]
    if differ:
        setting = "model.hf_assets_path" if config.model.hf_assets_path else f"model.flavor {config.model.flavor!r}"
        raise ConfigError(f"checkpoint.initial_load_path: {start} holds another model than {setting} "
                          f"({', '.join(differ)} differ){record_hint(start)}")


def _source_line(model: ResolvedModel, config: JobConfig) -> str:
    """Where the model comes from, for the start-up line."""
    if model.record:
        return f"{describe(model.args)} (recorded in {model.record})"
    folder = config.model.hf_assets_path
    return f"{describe(model.args)} (from {folder}/config.json)" if folder else f"flavor {config.model.flavor}"


def _recorded_changes(model: ResolvedModel, config: JobConfig) -> tuple[str, ...]:
    """Each model setting given that changes what the start recorded, ``setting recorded -> new`` (the RoPE
    scaling keyed by the settings given: type or length alone re-scale at the recorded factor)."""
    m, args, recorded = config.model, model.args, model.base
    out = {}
    if args.rope_theta != recorded.rope_theta:
        out["model.rope_theta"] = (recorded.rope_theta, args.rope_theta)
    if args.rope_scaling != recorded.rope_scaling:
        given = ",".join(f"model.{f}" for f in _SCALING if getattr(m, f))
        out[given] = (_rope(recorded.rope_scaling), _rope(args.rope_scaling))
    if recorded.moe is not None and args.moe.aux_loss_coef != recorded.moe.aux_loss_coef:
        out["model.router_aux_loss_coef"] = (recorded.moe.aux_loss_coef, args.moe.aux_loss_coef)
    return tuple(f"{k} {old} -> {new} (the config's; {model.record} recorded {old})" for k, (old, new) in out.items())


def _recorded_notes(model: ResolvedModel, config: JobConfig) -> tuple[str, ...]:
    """The RoPE the start recorded where the config leaves it to the model and its named model differs:
    noted (a setting the config gives is an override, named by :func:`_recorded_changes`)."""
    m = config.model
    left = (("rope_theta", repr, m.rope_theta <= 0),
            ("rope_scaling", _rope, m.rope_scaling_factor <= 0 and not any(getattr(m, f) for f in _SCALING)))
    return tuple(f"{f} {show(getattr(model.args, f))} from the checkpoint's model_args.json (the config says "
                 f"{show(getattr(model.named, f))})" for f, show, unset in left
                 if unset and getattr(model.args, f) != getattr(model.named, f))


def _rope(scaling) -> str:
    return f"{scaling.rope_type} x{scaling.factor:g}" if scaling else "none"


def merged_advice(checkpoint: str) -> str:
    """How to start a run with other adapters (or none) from a LoRA checkpoint: from its merged model."""
    return (f"or start from its merged model: titan-export --checkpoint {checkpoint} --output DIR, then "
            f"--model.hf_assets_path DIR without checkpoint.initial_load_path")


def _lora_changes(config: JobConfig, start: str) -> tuple[str, ...]:
    """A new run from LoRA checkpoint ``start`` continues its adapters: another rank, other targets or none
    (which would drop them, or not fit them) is a one-line refusal; another alpha or dropout is named."""
    record = read_lora_record(start) if _is_checkpoint(start) else None
    if record is None:
        return ()  # a base without adapters: any [lora] settings start from it
    lora, targets = config.lora, parse_lora_targets(",".join(record["target_modules"]))
    recorded = f"lora.rank {record['r']}, lora.target_modules {','.join(targets)}"
    try:
        mine = parse_lora_targets(lora.target_modules) if lora.rank else ()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if lora.rank == 0 or lora.rank != record["r"] or mine != targets:
        what = ("lora.rank 0 would drop them" if lora.rank == 0 else
                f"lora.rank {lora.rank} cannot hold rank-{record['r']} adapters" if lora.rank != record["r"] else
                f"lora.target_modules {','.join(mine)} would drop {len(set(targets) - set(mine))} of its "
                f"{len(targets)} trained adapters" + (f" and add {','.join(t for t in mine if t not in targets)}"
                                                      if set(mine) - set(targets) else ""))
        raise ConfigError(f"checkpoint.initial_load_path {start} holds LoRA adapters ({recorded}); this run's "
                          f"{what}: set those [lora] settings to train them further, {merged_advice(start)}")
    changed = [(f"lora.{k}", record[r], getattr(lora, k))
               for k, r in (("alpha", "lora_alpha"), ("dropout", "lora_dropout")) if getattr(lora, k) != record[r]]
    return tuple(f"{k} {old} -> {new} (the config's; {start} recorded {old})" for k, old, new in changed)


def _tokenizer_change(record: str, spec_kind: str, path: str, tok) -> tuple[str, ...]:
    """Another tokenizer than the one the record's run was trained with (its data settings): named."""
    try:
        settings = read_data_settings(record)
    except (OSError, ValueError, RuntimeError, EOFError):  # unreadable settings: nothing to compare (no note)
        settings = None
    if not settings or "tokenizer" not in settings:
        return ()
    kind, content = settings["tokenizer"], settings.get("tokenizer_content")
    if kind == spec_kind and content in (None, tok.fingerprint):
        return ()
    what = kind if kind != spec_kind else f"another {kind} tokenizer"
    mine = f"{spec_kind} {path}" if path else spec_kind
    return (f"model.tokenizer {mine} (the config's; {record} was trained with {what})",)


def check_vocab(args: DecoderArgs, kind: str, vocab: int, pretrained: bool, source: str) -> None:
    """The tokenizer fits the model's vocabulary (``source``: the setting the model comes from): a
    one-line ConfigError naming the settings otherwise."""
    if vocab > args.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab} ids but {source} has vocab_size {args.vocab_size}")
    if pretrained and 2 * vocab < args.vocab_size:
        raise ConfigError(f"model.tokenizer {kind!r} has {vocab} ids but {source} has a pretrained vocabulary of "
                          f"{args.vocab_size}: not its tokenizer; leave model.tokenizer unset (or set 'hf') to use "
                          f"the folder's tokenizer.json")


def with_tokenizer(config: JobConfig, spec: RunSpec) -> RunSpec:
    """``spec`` with its tokenizer read and checked against the model it resolved (its ids against the
    vocabulary; another tokenizer than the record's named): what ``resolve_run`` adds unless told not to, and
    what ``preflight.check_files`` adds once it has checked the tokenizer's file. ConfigError otherwise."""
    try:
        tok = resolve_tokenizer(config.model)
    except TokenizerError as e:
        raise ConfigError(str(e)) from e
    model = spec.model
    pretrained = model.pretrained or spec.weights.kind == "hf"  # an architecture alone (random init) has no vocabulary yet
    check_vocab(spec.args, spec.tokenizer, tok.vocab_size, pretrained, model.base_from)
    changed = _tokenizer_change(spec.record, spec.tokenizer, spec.tokenizer_path, tok) if spec.record else ()
    return dataclasses.replace(spec, tokenizer_vocab=tok.vocab_size, tokenizer_object=tok,
                               overrides=spec.overrides + changed)


def resolve_run(config: JobConfig, start: str | None = None, tokenizer: bool = True) -> RunSpec:
    """The run's spec, by the rule above. ``start``: the checkpoint whose record counts (default
    ``checkpoint.initial_load_path``; a tool passes the checkpoint it evaluates or exports);
    ``tokenizer`` False leaves the tokenizer unread (tools run where its file is absent; :func:`with_tokenizer`
    adds it later). Sets ``config.model.hf_assets_path`` and ``model.tokenizer`` to what it resolved.
    ConfigError otherwise."""
    of_run = start is None  # the run's own start checkpoint, not one a tool reads
    start = config.checkpoint.initial_load_path if start is None else start
    override_list(config)  # a name that is not a recorded setting is refused, record or not
    model = resolve_model(config, start)
    named = _recorded_changes(model, config) if model.record else ()
    notes = _recorded_notes(model, config) if model.record else ()
    if of_run:
        named += _lora_changes(config, start)
    m, t = config.model, config.training
    kind, path, _ = tokenizer_source(m)
    spec = RunSpec(args=model.args, source=_source_line(model, config), hf_folder=m.hf_assets_path,
                   record=model.record, tokenizer=kind, tokenizer_path=path, tokenizer_vocab=0,
                   weights=fresh_source(config), seq_len=t.seq_len, dataset=t.dataset, dataset_path=t.dataset_path,
                   overrides=named, notes=notes, model=model)
    if tokenizer:
        spec = with_tokenizer(config, spec)
    m.tokenizer = kind
    return spec
