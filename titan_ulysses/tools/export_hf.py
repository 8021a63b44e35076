"""Export a titan-ulysses checkpoint to a Hugging Face model folder, for every registered family
(``titan_ulysses/models/families/``: llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, glm,
and the mixtures of experts mixtral, qwen3_moe, gpt_oss).

    python scripts/export_hf.py --checkpoint outputs/needle_demo/checkpoint/step-400 \\
        --output outputs/needle_demo/hf [--dtype float32] [--max-shard-size 5GB]

The weights are written in the dtype they came in: a run started from a Hugging Face folder
exports the dtype of that folder's safetensors (recorded in the checkpoint; the output line says
so when its config.json names another), a run from scratch the dtype of its saved parameters
(float32); --dtype overrides (e.g. bfloat16 for a smaller folder). The checkpoint is verified
against its manifest first: a damaged one is refused, nothing is written. An --output that is,
holds or lies inside a run or a checkpoint is always refused; a non-empty one is refused unless it
holds nothing but a previous export and --overwrite is given (then replaced whole); the folder is
written beside --output and renamed into place once complete (``runs/outputs.py``).

Every checkpoint records the model arguments it was trained with (``model_args.json``)
and, for runs started from a Hugging Face folder, that folder's config.json and tokenizer
files (``hf_assets/``): the export is then a complete folder that
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load. Weights above
--max-shard-size are split into ``model-0000i-of-0000n.safetensors`` with an index.

A LoRA run's checkpoint exports as the merged model (each adapted weight W + alpha/rank * B @ A);
with --adapter-only it exports as a peft folder instead (adapter_config.json +
adapter_model.safetensors, the base model named in it) for ``peft.PeftModel.from_pretrained``.

Checkpoints written before the record existed: pass --flavor (and --rope-theta /
--rope-scaling-factor when the run overrode model.rope_theta / model.rope_scaling_factor).
"""

import argparse
import re
import sys

import torch

from titan_ulysses.checkpoint.steps import missing_checkpoint
from titan_ulysses.interop.hf_export import export_hf, source_dtype
from titan_ulysses.interop.peft_export import export_peft_adapter
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.run_spec import resolve_run
from titan_ulysses.runs.outputs import output_problem, staged_folder

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes (Hugging Face's units: KB/MB/GB are powers of 10, KiB/MiB/GiB of 2)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def spec_args(a, settings: list[str]):
    """The model of the checkpoint by the run spec's rule (``titan_ulysses/run_spec.py``), as training and the
    evals resolve it: its record wins; --flavor / --rope-* (checkpoints without a record) and further
    ``--section.key value`` settings are the config (a RoPE setting that changes the record is refused unless
    ``--checkpoint.override_recorded`` lists it). Nothing is written before export_hf verifies the checkpoint."""
    flags = [("--model.flavor", a.flavor), ("--model.rope_theta", a.rope_theta),
             ("--model.rope_scaling_factor", a.rope_scaling_factor)]
    argv = [x for key, value in flags if value for x in (key, str(value))] + settings
    try:
        config = load_config(argv)
        spec = resolve_run(config, start=a.checkpoint, tokenizer=False)
    except ConfigError as e:
        raise ValueError(str(e)) from e
    if not spec.record and not a.flavor and not config.model.hf_assets_path:
        raise ValueError(f"{a.checkpoint!r} has no model_args.json (a checkpoint written before it existed); "
                         f"pass --flavor (and the run's rope overrides)")
    return spec.args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder")
    parser.add_argument("--output", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="the weights' dtype (default: the dtype they came in: the source safetensors', "
                             "else the saved parameters')")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB",
                        help="largest safetensors file; above it the weights are sharded with an index (default 5GB)")
    parser.add_argument("--flavor", default="", help="model.flavor, only for checkpoints without model_args.json")
    parser.add_argument("--rope-theta", type=float, default=0.0, help="with --flavor: model.rope_theta of the run")
    parser.add_argument("--rope-scaling-factor", type=float, default=0.0,
                        help="with --flavor: model.rope_scaling_factor of the run")
    parser.add_argument("--max-position-embeddings", type=int, default=131072,
                        help="max_position_embeddings written to config.json (the source folder's value wins)")
    parser.add_argument("--adapter-only", action="store_true",
                        help="LoRA checkpoints: write only the adapters, as a peft folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --output folder that holds a previous export, whole (never a run or other files)")
    parser.add_argument("--base-model", default="",
                        help="with --adapter-only: base_model_name_or_path to write (default: the run's model.hf_assets_path)")
    a, settings = parser.parse_known_args(argv)
    try:
        # before anything else: the checkpoint is there, and the output would overwrite nothing by surprise
        for problem in (missing_checkpoint(a.checkpoint, "--checkpoint"),
                        output_problem("--output", a.output, a.overwrite, folder=True, checkpoint=a.checkpoint)):
            if problem:
                raise ValueError(problem)
        if a.adapter_only:
            with staged_folder(a.output, mark=True) as tmp:  # written whole beside it, then renamed into place
                written = export_peft_adapter(a.checkpoint, tmp, a.base_model)
            print(f"wrote {a.output}: {', '.join(written)}")
            return 0
        args = spec_args(a, settings)
        dtype = getattr(torch, a.dtype) if a.dtype else None  # None: export_hf takes source_dtype's, once verified
        with staged_folder(a.output, mark=True) as tmp:
            written = export_hf(a.checkpoint, args, tmp, dtype, a.max_position_embeddings, a.max_shard_size)
        dtype, how = (dtype, "--dtype") if dtype else source_dtype(a.checkpoint)
    except (OSError, ValueError) as e:
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.output} ({str(dtype).removeprefix('torch.')}, {how}): {', '.join(written)}")
    return 0


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts])."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
