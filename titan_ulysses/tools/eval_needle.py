"""Passkey (needle-in-a-haystack) retrieval of a checkpoint over context lengths x needle depths.

    torchrun --nproc-per-node 2 scripts/eval_needle.py --config train_configs/needle_demo.toml \\
        --checkpoint outputs/needle_demo/checkpoint/step-400 \\
        --lengths 96,128,192,256,512 --samples 16 --output docs/figures/needle_demo

(the figure of the README's main job; ``docs/figures/needle_debug_model`` is ``debug_model.toml``'s
``step-100`` with ``--lengths 128,256,512,1024 --depths 0,0.25,0.5,0.75,1``.)

What the checkpoint records wins over the config, by ``titan_ulysses/run_spec.py``'s rule (the
checkpoint is the record, as a start checkpoint is in training): the model arguments of its
``model_args.json`` (shapes, RoPE theta and scaling; its ``hf_assets/`` when the config names
no Hugging Face folder) and the data settings it was trained with (``trained_seq_len``, the
pass key's digits, the tokenizer). A RoPE setting that changes the record is refused unless
``--checkpoint.override_recorded`` lists it (then named); ``--training.passkey_digits`` overrides.

The model is laid out exactly as the training config says (Ulysses degree, FSDP), so
evaluation at a length needs what training at that length needs; further ``--section.key
value`` arguments override the config (e.g. ``--parallelism.ulysses_degree 1`` to run as
one process). Each cell holds ``--samples`` prompts: filler text with a pass key of the
config's ``training.passkey_digits`` digits at the given depth, then the question. A sample
counts as retrieved when the greedy prediction of every answer digit (each predicted from
the true prefix) is right; the per-digit accuracy and the mean negative log-likelihood of
a digit are reported too (chance: 0.1 and ln 10 = 2.30). Writes ``<output>.json`` and the heatmap ``<output>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.eval_model import load_eval_model
from titan_ulysses.interop.hf_export import read_data_settings
from titan_ulysses.checkpoint.verify import verify_checkpoint
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.data.datasets import make_passkey_tokens, random_passkey
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.distributed.setup import init_distributed, leave_job
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.ops.loss import IGNORE_INDEX
from titan_ulysses.preflight import validate
from titan_ulysses.run_spec import resolve_run


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the training config (model and layout)")
    p.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder")
    p.add_argument("--lengths", default="128,256,512,1024", help="context lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths within the filler, 0..1")
    p.add_argument("--samples", type=int, default=8, help="prompts per cell")
    p.add_argument("--output", default="needle", help="path prefix for .json and .png")
    a, overrides = p.parse_known_args(argv)
    try:
        a.lengths = [int(x) for x in a.lengths.split(",")]
        a.depths = [float(x) for x in a.depths.split(",")]
    except ValueError as e:
        raise SystemExit(f"--lengths / --depths: comma-separated numbers expected ({e})") from e
    if any(not 0.0 <= d <= 1.0 for d in a.depths):
        raise SystemExit(f"--depths {a.depths}: every depth must lie within [0, 1]")
    if a.samples < 1:
        raise SystemExit(f"--samples {a.samples} must be >= 1")
    try:  # before anything reads it (its record, its data settings): each process checks it whole
        verify_checkpoint(a.checkpoint, "--checkpoint")
    except (OSError, ValueError) as e:
        raise SystemExit(str(e)) from e
    return a, overrides


def _given(overrides: list[str], key: str) -> bool:
    return any(o == f"--{key}" or o.startswith(f"--{key}=") for o in overrides)


def apply_record(config, checkpoint: str, overrides: list[str], spec) -> tuple[dict | None, list[str]]:
    """The pass key digits from the data settings the checkpoint records (the model, its RoPE and the
    tokenizer are ``spec``'s: ``run_spec.resolve_run`` with the checkpoint as the record).

    Returns (the checkpoint's data settings or None, notes for the user).
    """
    notes = list(spec.notes) + [f"override: {o}" for o in spec.overrides]
    if not spec.record:
        notes.append(f"{checkpoint} has no model_args.json (written before it existed): the model comes from "
                     f"the config")
    settings = read_data_settings(checkpoint)
    if settings is None:
        notes.append(f"{checkpoint} records no data settings: trained_seq_len is unknown")
        return None, notes
    if settings.get("tokenizer") not in (None, spec.tokenizer):
        raise SystemExit(f"the checkpoint was trained with model.tokenizer {settings['tokenizer']!r} but the config "
                         f"says {spec.tokenizer!r}: pass --model.tokenizer {settings['tokenizer']} "
                         f"(and its path)")
    if "passkey_digits" in settings and not _given(overrides, "training.passkey_digits"):
        config.training.passkey_digits = settings["passkey_digits"]
    return settings, notes


def passkey(length: int, depth: float, i: int, digits: int) -> int:
    """Keys drawn apart from the training stream (which draws from the training seed)."""
    return random_passkey(random.Random(f"needle:{length}:{depth}:{i}"), digits)


def build_cell(tokenizer, length: int, depth: float, n: int, digits: int):
    """Full-sequence inputs and labels ``[n, length]``; labels only on the answer digits."""
    inputs, labels = [], []
    for i in range(n):
        tokens, answer_start = make_passkey_tokens(tokenizer, length, passkey(length, depth, i, digits), depth)
        t = torch.tensor(tokens)
        lab = torch.full((length,), IGNORE_INDEX)
        lab[answer_start - 1:] = t[answer_start:]  # position p predicts token p + 1
        inputs.append(t[:-1])
        labels.append(lab)
    return torch.stack(inputs), torch.stack(labels)


@torch.no_grad()
def evaluate_cell(model, pd, tokenizer, device, length, depth, n, digits) -> tuple[float, float, float]:
    """(fraction of samples retrieved, fraction of answer digits right, mean NLL of a digit) for one cell."""
    dp_mesh, sp_mesh = pd.get_mesh("dp"), pd.get_mesh("sp")
    inputs, labels = build_cell(tokenizer, length, depth, n, digits)
    mine = torch.arange(n) % dp_mesh.size() == dp_mesh.get_local_rank()  # dp ranks split the samples
    correct = torch.zeros(n, device=device)  # answer digits right, per sample
    total = torch.zeros(n, device=device)
    nll = torch.zeros(n, device=device)  # summed negative log-likelihood of the answer digits
    if mine.any():
        b = shard_batch(inputs[mine], labels[mine], sp_mesh.get_local_rank(), sp_mesh.size(),
                        pad_token=tokenizer.pad_id)
        logits = model(b.tokens.to(device), positions=b.positions.to(device))  # [n/dp, S/sp, V]
        lab = b.labels.to(device)
        hit = (logits.argmax(-1) == lab) & (lab != IGNORE_INDEX)
        correct[mine.to(device)] = hit.sum(1).float()
        total[mine.to(device)] = (lab != IGNORE_INDEX).sum(1).float()
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), lab, ignore_index=IGNORE_INDEX,
                                               reduction="none")  # [n/dp, S/sp]
        nll[mine.to(device)] = ce.sum(1)
    else:  # this dp rank has no sample but must join the collectives of its sp group
        b = shard_batch(inputs[:1], labels[:1], sp_mesh.get_local_rank(), sp_mesh.size(), pad_token=tokenizer.pad_id)
        model(b.tokens.to(device), positions=b.positions.to(device))
    for t in (correct, total, nll):
        dist.all_reduce(t)  # sp ranks hold different digits, dp ranks different samples
    correct, total, nll = correct / pd.tp, total / pd.tp, nll / pd.tp  # tp ranks all hold the same logits
    retrieved = (correct == total).float().mean().item()
    return retrieved, (correct.sum() / total.sum()).item(), (nll.sum() / total.sum()).item()


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = torch.tensor(result["accuracy"])  # [depths, lengths]
    fig, ax = plt.subplots(figsize=(1.4 + 1.1 * len(result["lengths"]), 1.2 + 0.6 * len(result["depths"])))
    im = ax.imshow(acc.numpy(), cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), v in [((i, j), acc[i, j].item()) for i in range(acc.shape[0]) for j in range(acc.shape[1])]:
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(result["lengths"])), [str(x) for x in result["lengths"]])
    ax.set_yticks(range(len(result["depths"])), [f"{100 * d:.0f}%" for d in result["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    trained = result.get("trained_seq_len")
    ax.set_title(f"passkey retrieval, {result['digits']}-digit key, {result['samples']} samples/cell\n"
                 f"{os.path.basename(result['checkpoint'].rstrip('/'))}, trained at {trained}, layout {result['layout']}",
                 fontsize=9)
    fig.colorbar(im, ax=ax, label="retrieved")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prepare(a, overrides: list[str], world: int):
    """(config, spec, data settings, notes, layout) before any process group; SystemExit naming a refusal."""
    try:
        config = load_config(["--config", a.config, *overrides])
        spec = resolve_run(config, start=a.checkpoint)  # the checkpoint's record, as training resolves a start
        settings, notes = apply_record(config, a.checkpoint, overrides, spec)
        return config, spec, settings, notes, validate(config, world, spec)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from e


def main(argv=None) -> int:
    a, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, spec, settings, notes, pd = prepare(a, overrides, world)
    tokenizer = spec.tokenizer_object
    digits = config.training.passkey_digits
    for length in a.lengths:  # refuse a too-short length before any process group
        try:
            make_passkey_tokens(tokenizer, length, 10**digits - 1, 0.5)
        except ValueError as e:
            raise SystemExit(f"--lengths: {length} is too short for a passkey prompt ({e})") from e
    device = init_distributed()
    pd.build_mesh(device.type)
    args = spec.args
    model = load_eval_model(args, ComputeOptions.from_config(config.model), pd, device, a.checkpoint)
    grid = [[evaluate_cell(model, pd, tokenizer, device, length, depth, a.samples, digits) for length in a.lengths]
            for depth in a.depths]
    result = {
        "checkpoint": a.checkpoint, "config": a.config, "overrides": overrides, "layout": pd.degrees,
        "trained_seq_len": settings["seq_len"] if settings else None, "digits": digits,
        "rope_theta": args.rope_theta, "rope_scaling_factor": args.rope_scaling.factor if args.rope_scaling else None,
        "lengths": a.lengths, "depths": a.depths, "samples": a.samples,
        "accuracy": [[cell[0] for cell in row] for row in grid],
        "digit_accuracy": [[cell[1] for cell in row] for row in grid],
        "digit_nll": [[cell[2] for cell in row] for row in grid],
    }
    if dist.get_rank() == 0:
        for note in notes:
            print(f"note: {note}", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
        with open(a.output + ".json", "w") as f:
            json.dump(result, f, indent=1)
        draw(result, a.output + ".png")
        print(f"{'depth':>6} " + " ".join(f"{n:>7}" for n in a.lengths))
        for depth, row in zip(a.depths, result["accuracy"]):
            print(f"{100 * depth:5.0f}% " + " ".join(f"{v:7.2f}" for v in row))
        print(f"wrote {a.output}.json and {a.output}.png")
    return 0  # the process group is left by cli (distributed/setup.py's leave_job)


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts]); never returns."""
    leave_job(main())


if __name__ == "__main__":
    cli()
