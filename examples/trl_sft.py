"""TRL's SFTTrainer at sp=2: the script TRL's docs write, plus two lines (marked ``# + Ulysses``).

    torchrun --nproc-per-node 2 examples/trl_sft.py --model MODEL_FOLDER --sp 2 --output outputs/trl_sft

``MODEL_FOLDER``: any transformers causal LM folder with its tokenizer (scripts/smollm2_folder.py
writes SmolLM2-135M-Instruct; ``--layers 2`` keeps its first layers for a quick CPU run). The
rows are prompt/completion pairs cut from a text file's paragraphs (first sentence -> the rest),
trained with completion-only loss. Every rank of an sp group gets the same rows; each holds S/sp
tokens of every row; the loss is the token mean of the whole step. It runs under DDP, or with
``--fsdp`` under accelerate's FSDP2 (CPU on gloo too). At the end ``save_model`` writes a folder
that transformers loads as usual.
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a transformers causal LM folder with its tokenizer")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--text", default="README.md")
    p.add_argument("--output", default="outputs/trl_sft")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 through accelerate (else DDP)")
    args = p.parse_args()

    extra = {"num_hidden_layers": args.layers} if args.layers else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa", **extra)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = SFTConfig(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=2,
                       gradient_accumulation_steps=2, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                       report_to=[], max_length=256, completion_only_loss=True, bf16=torch.cuda.is_available(),
                       use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
                       **({"fsdp": True, "fsdp_config": {"version": 2}} if args.fsdp else {}))
    trainer = SFTTrainer(model=model, args=config, train_dataset=pairs(args.text), processing_class=tokenizer)
    trainer = ulysses_trainer(trainer, sp=args.sp)  # + Ulysses
    trainer.train()
    trainer.save_model(args.output)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        wrap = "FSDP2" if trainer.accelerator.is_fsdp2 else "DDP"
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps at sp={args.sp} under {wrap}; "
              f"saved {args.output}", flush=True)


if __name__ == "__main__":
    main()
