"""LoRA checkpoints -> Hugging Face: the merged model, or a peft adapter folder.

A LoRA run's checkpoints hold the frozen base weights under their usual names and the
adapters as ``<projection>.lora_A`` ``[rank, in]`` / ``.lora_B`` ``[out, rank]``, plus
``lora.json`` (rank, alpha, dropout, targets and the base model's folder; written by the
trainer beside ``model_args.json``). Two exports:

* merged (``export_hf``): each adapted weight becomes ``W + alpha/rank * B @ A`` (fp32, then
  the export dtype): a plain model that ``AutoModelForCausalLM`` loads;
* adapter only (:func:`export_peft_adapter`): ``adapter_config.json`` and
  ``adapter_model.safetensors`` with peft's names (``base_model.model.model.layers.0.self_attn.
  q_proj.lora_A.weight``), which ``peft.PeftModel.from_pretrained(base, folder)`` loads onto
  the base model. B of q_proj / k_proj is put in Hugging Face's RoPE layout, as the merged
  q/k weights are (its rows are the weight's rows; A's columns are not permuted).
"""

from __future__ import annotations

import json
import os

import torch

RECORD = "lora.json"
_A, _B = ".lora_A", ".lora_B"


def base_model_reference(base_model: str) -> str:
    """What peft's ``base_model_name_or_path`` records: a local folder as its absolute path (a relative one would
    be read against wherever the adapter is loaded), anything else (a Hub id, a flavor's name) as given."""
    return os.path.abspath(base_model) if base_model and os.path.isdir(base_model) else base_model


def write_lora_record(step_dir: str, options, base_model: str) -> None:
    """``lora.json`` of a checkpoint (nothing when ``options`` is None: not a LoRA run)."""
    if options is None:
        return
    record = {"r": options.rank, "lora_alpha": options.alpha, "lora_dropout": options.dropout,
              "target_modules": list(options.targets), "base_model_name_or_path": base_model_reference(base_model)}
    with open(os.path.join(step_dir, RECORD), "w") as f:
        json.dump(record, f, indent=2)


def read_lora_record(checkpoint_dir: str) -> dict | None:
    path = os.path.join(checkpoint_dir, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def pop_adapters(meta: dict) -> dict[str, tuple[str, str]]:
    """Remove the adapters from ``meta`` (name -> metadata of a checkpoint's model); returns
    base weight name -> (A name, B name)."""
    adapters = {}
    for name in [n for n in meta if n.endswith(_A)]:
        module = name[: -len(_A)]
        adapters[f"{module}.weight"] = (name, module + _B)
        meta.pop(name)
        meta.pop(module + _B)
    return adapters


def scaling_of(checkpoint_dir: str, adapters: dict) -> float:
    """alpha / rank of a checkpoint with adapters; refuses one without its ``lora.json``."""
    if not adapters:
        return 0.0
    record = read_lora_record(checkpoint_dir)
    if record is None:
        raise ValueError(f"{checkpoint_dir!r} holds LoRA adapters but no {RECORD} (their alpha): "
                         f"it was not written by a LoRA run of this trainer")
    return record["lora_alpha"] / record["r"]


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B @ A`` in fp32."""
    return weight.float() + (lora_b.float() @ lora_a.float()) * scaling


def export_peft_adapter(checkpoint_dir: str, output_dir: str, base_model: str = "") -> list[str]:
    """Write a peft LoRA folder for a LoRA checkpoint; ``base_model`` overrides the recorded base."""
    from safetensors.torch import save_file

    from titan_ulysses.interop.hf_adapter import hf_tensors, ours_to_theirs
    from titan_ulysses.interop.model_record import model_metadata, read_model_record, read_model_weights
    from titan_ulysses.checkpoint.verify import verify_checkpoint

    verify_checkpoint(checkpoint_dir, "--checkpoint")  # it exists and matches its manifest, before any read
    record = read_lora_record(checkpoint_dir)
    model_record = read_model_record(checkpoint_dir)
    if record is None or model_record is None:
        raise ValueError(f"{checkpoint_dir!r} is not a LoRA checkpoint of this trainer (no {RECORD} or "
                         f"model_args.json): --adapter-only needs both")
    args = model_record[0]
    adapters = pop_adapters(dict(model_metadata(checkpoint_dir)))
    weights = read_model_weights(checkpoint_dir, [n for pair in adapters.values() for n in pair])
    names = {parts[0][0]: (theirs, parts[0][1]) for theirs, parts in hf_tensors(args).items() if len(parts) == 1}
    fused = sorted(base for base in adapters if base not in names)
    if fused:  # e.g. Phi-3's qkv_proj holds our wq, wk, wv: one peft adapter per HF module cannot keep them apart
        raise ValueError(f"--adapter-only: {args.family} fuses {fused[0]} with other projections into one Hugging "
                         f"Face module, which a peft adapter cannot express per projection; export the merged "
                         f"model (without --adapter-only)")
    state = {}
    for base, (a, b) in adapters.items():
        theirs, heads = names[base]  # model.layers.0.self_attn.q_proj.weight
        prefix = "base_model.model." + theirs[: -len(".weight")]
        state[f"{prefix}.lora_A.weight"] = weights[a].float().contiguous()
        lora_b = weights[b].float()
        state[f"{prefix}.lora_B.weight"] = ours_to_theirs(lora_b, heads, args).contiguous()
    os.makedirs(output_dir, exist_ok=True)
    save_file(state, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_reference(base_model) or record["base_model_name_or_path"],
        "r": record["r"], "lora_alpha": record["lora_alpha"], "lora_dropout": record["lora_dropout"],
        "target_modules": record["target_modules"], "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "revision": None,
    }
    with open(os.path.join(output_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return ["adapter_model.safetensors", "adapter_config.json"]


def model_only_planner(model, path: str):
    """The DCP load planner for loading only the weights of checkpoint ``path`` into ``model``
    (``checkpoint.initial_load_path``), or None for the default.

    A checkpoint without adapters into a LoRA run (LoRA on a fine-tuned or context-extended
    base) loads every base weight and leaves the adapters as initialised. A LoRA checkpoint into
    a run without those adapters (none, other targets or another rank) is refused: they would be
    dropped without a word, or not fit (``run_spec`` refuses it first, before any process group).
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: tuple(m.size) for k, m in meta.items() if k.startswith("model.")}
    mine = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    adapters = {k for k in mine if k.endswith((_A, _B))}
    theirs = {k: shape for k, shape in saved.items() if k.endswith((_A, _B))}
    if theirs and any(mine.get(k) != shape for k, shape in theirs.items()):
        raise ValueError(
            f"checkpoint.initial_load_path {path!r} holds LoRA adapters that this run's [lora] settings would drop "
            f"or cannot hold: set lora.rank / lora.target_modules as that run had (its {RECORD}), or start from its "
            f"merged export (titan-export) as model.hf_assets_path"
        )
    missing = set(mine) - set(saved)
    if missing and missing <= adapters:
        return DefaultLoadPlanner(allow_partial_load=True)  # only adapters are missing: they keep their init
    return None


class AdapterMismatchError(ValueError):
    """A checkpoint's adapters differ from this run's [lora] settings: refused, never set aside as damaged."""


def check_adapters(model, saved_metadata: dict, path: str) -> None:
    """Refuse to resume ``path`` into ``model`` when their LoRA adapters differ (names or shapes),
    in one line naming the settings; ``saved_metadata`` is the checkpoint's state_dict_metadata."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    saved = {k[len("model."):]: tuple(m.size) for k, m in saved_metadata.items()
             if k.startswith("model.") and k.endswith((_A, _B))}
    mine = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items() if k.endswith((_A, _B))}
    if saved == mine:
        return
    def rank(adapters: dict) -> int:
        return next((shape[0] for name, shape in adapters.items() if name.endswith(_A)), 0)

    record = read_lora_record(path)
    targets = f", lora.target_modules {','.join(record['target_modules'])}" if record and saved else ""
    theirs, ours = f"lora.rank {rank(saved)}{targets}", f"lora.rank {rank(mine)}"
    raise AdapterMismatchError(
        f"checkpoint {path} was written with {theirs}, this run has {ours} (or other lora.target_modules): "
        f"resume with the checkpoint's [lora] settings, or start a new run (another job.dump_folder) from its merged "
        f"model: titan-export --checkpoint {path} --output DIR, then --model.hf_assets_path DIR"
    )
