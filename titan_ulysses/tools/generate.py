"""Greedy generation from a checkpoint (or a Hugging Face folder) at the training layout, with the run's tokenizer.

    torchrun --nproc-per-node 2 scripts/generate.py --config train_configs/X.toml \\
        --checkpoint outputs/X/checkpoint/step-N (or the Hugging Face folder it started from) \\
        (--prompt TEXT | --chat TEXT [--system TEXT]) [--max-new-tokens 32] [--output outputs/X/generation.json]

``--prompt`` continues raw text (after the tokenizer's BOS, as training documents start);
``--chat`` sends one user message (after ``--system``'s, if given) through the run's chat
template (as SFT renders it: the tokenizer's own, or ``training.chat_template``) with the
generation prompt, and stops at the tokenizer's EOS. The model is laid out as the config says (Ulysses, context
parallelism, FSDP, tensor parallelism; ``--section.key value`` overrides) and every new
token is one forward over the whole sequence, no KV cache: a tool for looking at what a
run learned, not a server. Rank 0 prints the text and, with ``--output``, writes it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.eval_model import check_weights, load_eval_model
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.data.chat import load_chat_template
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.data.sources import DataError
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.preflight import validate
from titan_ulysses.run_spec import resolve_run
from titan_ulysses.distributed.setup import init_distributed, leave_job


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the training config (model, tokenizer and layout)")
    p.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder, or a Hugging Face folder")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="raw text to continue")
    text.add_argument("--chat", help="one user message, rendered with the run's chat template")
    p.add_argument("--system", default="", help="with --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--output", default="", help="a .json file for the prompt and the generated text")
    a, overrides = p.parse_known_args(argv)
    if a.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens {a.max_new_tokens} must be >= 1")
    return a, overrides


def prompt_ids(a, config, tokenizer) -> list[int]:
    if a.prompt is not None:
        return list(tokenizer.encode(a.prompt, True, False))  # as a training document starts
    template = load_chat_template(config.training.chat_template, tokenizer)  # as SFT finds it
    messages = [{"role": "system", "content": a.system}] * bool(a.system) + [{"role": "user", "content": a.chat}]
    text = template.render(messages, add_generation_prompt=True)
    return list(tokenizer.encode(text, False, False))  # the template writes its own BOS where it has one


@torch.no_grad()
def generate(model, pd, ids: list[int], steps: int, stop: int | None, pad_id: int, device) -> list[int]:
    """Greedy continuation of ``ids``: each step one forward at the layout; the rank holding the last
    position picks the token and every rank receives it (a max over the world, the others offer -1)."""
    sp, cp = pd.get_mesh("sp"), pd.get_mesh("cp")
    new = []
    for _ in range(steps):
        tokens = torch.tensor([ids + new])
        b = shard_batch(tokens, tokens, sp.get_local_rank(), sp.size(), pad_token=pad_id,
                        cp_rank=cp.get_local_rank(), cp=cp.size())
        logits = model(b.tokens.to(device), positions=b.positions.to(device))  # [1, S/(sp cp), V]
        last = (b.index == tokens.shape[1] - 1).nonzero()
        pick = torch.tensor([int(logits[0, last[0, 0]].argmax()) if len(last) else -1], device=device)
        dist.all_reduce(pick, op=dist.ReduceOp.MAX)
        new.append(int(pick))
        if new[-1] == stop:
            break
    return new


def main(argv=None) -> int:
    a, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = load_config(["--config", a.config, *overrides])
        spec = resolve_run(config, start=a.checkpoint)  # the checkpoint's record (its RoPE), as training resolves it
        pd = validate(config, world, spec)
        tokenizer, args = spec.tokenizer_object, spec.args
        check_weights(a.checkpoint, args)
        ids = prompt_ids(a, config, tokenizer)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"generate: {e}") from e
    device = init_distributed()
    pd.build_mesh(device.type)
    model = load_eval_model(args, ComputeOptions.from_config(config.model), pd, device, a.checkpoint)
    new = generate(model, pd, ids, a.max_new_tokens, tokenizer.eos_id if a.chat is not None else None,
                   tokenizer.pad_id, device)
    if dist.get_rank() == 0:
        text = tokenizer.decode(new)
        print(f"{a.checkpoint}: {(a.prompt if a.prompt is not None else a.chat)!r} -> {text!r}")
        if a.output:
            os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
            with open(a.output, "w") as f:
                json.dump({"checkpoint": a.checkpoint, "prompt": a.prompt, "chat": a.chat, "prompt_ids": ids,
                           "new_ids": new, "text": text}, f, indent=1)
    return 0  # the process group is left by cli (distributed/setup.py's leave_job)


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts]); never returns."""
    leave_job(main())


if __name__ == "__main__":
    cli()
