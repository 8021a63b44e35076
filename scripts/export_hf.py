"""Export a titan-ulysses checkpoint to Hugging Face Llama format.

    python scripts/export_hf.py --checkpoint outputs/needle_demo/checkpoint/step-400 \
        --flavor debugmodel --output outputs/needle_demo/hf [--dtype bfloat16]

Pass the same --rope-theta / --rope-scaling-factor as model.rope_theta /
model.rope_scaling_factor when the run overrode them (context extension).
"""

import argparse
import dataclasses
import sys

import torch

from titan_ulysses.checkpoint.hf import export_hf
from titan_ulysses.models.llama.args import RopeScaling, get_flavor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder")
    parser.add_argument("--flavor", required=True, help="model.flavor of the run")
    parser.add_argument("--output", required=True, help="folder for config.json and model.safetensors")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rope-theta", type=float, default=0.0, help="model.rope_theta when the run overrode it")
    parser.add_argument("--rope-scaling-factor", type=float, default=0.0,
                        help="model.rope_scaling_factor when the run overrode it")
    parser.add_argument("--max-position-embeddings", type=int, default=131072,
                        help="max_position_embeddings written to config.json")
    a = parser.parse_args(argv)
    args = get_flavor(a.flavor)
    if a.rope_theta > 0:
        args = dataclasses.replace(args, rope_theta=a.rope_theta)
    if a.rope_scaling_factor > 0:
        args = dataclasses.replace(
            args, rope_scaling=dataclasses.replace(args.rope_scaling or RopeScaling(), factor=a.rope_scaling_factor)
        )
    export_hf(a.checkpoint, args, a.output, getattr(torch, a.dtype), a.max_position_embeddings)
    print(f"wrote {a.output}/config.json and {a.output}/model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
