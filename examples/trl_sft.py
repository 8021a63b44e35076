"""TRL's SFTTrainer at sp=2: the script TRL's docs write, plus two lines (marked ``# + Ulysses``).

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/trl_sft.py --model MODEL_FOLDER --sp 2
    torchrun --nproc-per-node 2 examples/trl_sft.py --model MODEL_FOLDER --sp 2 [--fsdp]

``MODEL_FOLDER``: any transformers causal LM folder with its tokenizer (scripts/smollm2_folder.py
writes SmolLM2-135M-Instruct; ``--layers 2`` keeps its first layers for a quick CPU run). The
rows are prompt/completion pairs cut from a text file's paragraphs (first sentence -> the rest),
trained with completion-only loss. Every rank of an sp group gets the same rows; each holds S/sp
tokens of every row; the loss is the token mean of the whole step. Under ``accelerate launch`` with
an FSDP2 config it runs under FSDP2 (CPU on gloo too); under torchrun under DDP, or with ``--fsdp``
under FSDP2. At the end ``save_model`` writes a folder that transformers loads as usual, and rank 0
prints one JSON line of every step's loss and grad norm.
"""

from __future__ import annotations

import argparse
import json

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from titan_ulysses.integrations.transformers import ulysses_trainer  # + Ulysses


def pairs(path: str) -> Dataset:
    """Prompt/completion rows: each paragraph's first sentence, then its remainder."""
    rows = {"prompt": [], "completion": []}
    for para in open(path, encoding="utf-8").read().split("\n\n"):
        head, dot, tail = para.strip().partition(". ")
        if dot and len(tail) > 20:
            rows["prompt"].append(head + ".")
            rows["completion"].append(" " + tail)
    return Dataset.from_dict(rows)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers causal LM folder with its tokenizer")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--text", default="README.md")
    p.add_argument("--output", default="outputs/trl_sft")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--optim", default="adamw_torch", help="SFTConfig.optim (the test uses sgd)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 in SFTConfig (under torchrun; else DDP)")
    return p.parse_args(argv)


def make_trainer(args: argparse.Namespace) -> SFTTrainer:
    """The trainer as TRL's docs build it (no Ulysses yet)."""
    extra = {"num_hidden_layers": args.layers} if args.layers else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa", **extra)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = SFTConfig(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, learning_rate=args.lr, optim=args.optim, logging_steps=1,
                       save_strategy="no", report_to=[], max_length=256, completion_only_loss=True,
                       bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                       **({"fsdp": True, "fsdp_config": {"version": 2}} if args.fsdp else {}))
    return SFTTrainer(model=model, args=config, train_dataset=pairs(args.text), processing_class=tokenizer)


def main() -> None:
    args = parse()
    trainer = make_trainer(args)
    trainer = ulysses_trainer(trainer, sp=args.sp)  # + Ulysses
    trainer.train()
    trainer.save_model(args.output)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        wrap = "FSDP2" if trainer.accelerator.is_fsdp2 else "DDP"
        print(f"loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} in {len(logs)} steps at sp={args.sp} under "
              f"{wrap}; saved {args.output}", flush=True)
        print(json.dumps({"wrap": wrap, "loss": [h["loss"] for h in logs],
                          "grad_norm": [h["grad_norm"] for h in logs]}))


if __name__ == "__main__":
    main()
