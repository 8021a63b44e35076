"""Long-context evaluation of a checkpoint at the training layout: held-out loss by position,
and passkey / multi-key needle retrieval in real text, with the run's own tokenizer.

    torchrun --nproc-per-node 2 scripts/eval_long.py --config train_configs/X.toml \\
        --checkpoint outputs/X/checkpoint/step-N --data held_out/ [--seq-len 131072] \\
        [--buckets 8] [--max-docs 32] [--keys 1,4] [--needle-samples 8] --output outputs/X/eval_long

The model, its RoPE and the tokenizer are the run spec's (``titan_ulysses/run_spec.py``), with
``--checkpoint`` as the record: what it records wins over the config, as for a start checkpoint.
The model is laid out as the config says (Ulysses, context parallelism, FSDP, tensor
parallelism; ``--section.key value`` overrides), so a length that trained evaluates.
``--checkpoint`` may also be a Hugging Face folder of the config's shapes (e.g. its
``model.hf_assets_path``): the same numbers for the model before training.

* Loss by position: documents of ``--data`` (.txt files, .jsonl/.parquet rows with "text", other files whole)
  with at least ``--seq-len + 1`` tokens, each cut to one window of ``--seq-len``; the mean
  next-token loss of each of ``--buckets`` equal position ranges. A model that uses its
  context has a falling curve; a flat or rising tail means the far context does not help.
* Needles: a window of the same real text with ``k`` sentences "The pass key of <name> is
  <5 digits>." spread over it (one per ``--keys`` value k), then "What is the pass key of
  <one of the names>? The pass key of <name> is" and the key. Scored as ``eval_needle.py``:
  a sample is retrieved when the greedy prediction of every answer token (each from the true
  prefix) is right; the answer tokens' accuracy and mean NLL are reported too.

Writes ``<output>.json`` and ``<output>.png`` (loss by position, retrieval by number of keys).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.eval_model import check_weights, load_eval_model, weights_kind
from titan_ulysses.checkpoint.verify import verify_checkpoint
from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.data.sharding import shard_batch
from titan_ulysses.data.sources import DataError, list_files, read_rows, text_field, work_items
from titan_ulysses.distributed.setup import init_distributed, leave_job
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.ops.loss import IGNORE_INDEX
from titan_ulysses.preflight import validate
from titan_ulysses.run_spec import resolve_run

NAMES = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana", "Ivan", "Jules", "Kofi", "Lena",
         "Mateo", "Nadia", "Oscar", "Priya"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the training config (model, tokenizer and layout)")
    p.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder, or a Hugging Face folder "
                   "(its safetensors: e.g. model.hf_assets_path, the model before training)")
    p.add_argument("--data", required=True, help="held-out text, comma-separated: .txt/.jsonl/.parquet files or "
                   "folders of them; any other file is one plain-text document")
    p.add_argument("--seq-len", type=int, default=0, help="window length (default: the config's training.seq_len)")
    p.add_argument("--buckets", type=int, default=8, help="position ranges of the loss curve")
    p.add_argument("--max-docs", type=int, default=32, help="documents of the loss curve at most")
    p.add_argument("--keys", default="1,4", help="needle counts per window (1: passkey; more: multi-key)")
    p.add_argument("--needle-samples", type=int, default=8, help="windows per needle count")
    p.add_argument("--output", default="eval_long", help="path prefix for .json and .png")
    a, overrides = p.parse_known_args(argv)
    try:
        a.keys = [int(x) for x in a.keys.split(",")]
    except ValueError as e:
        raise SystemExit(f"--keys: comma-separated counts expected ({e})") from e
    if any(not 1 <= k <= len(NAMES) for k in a.keys):
        raise SystemExit(f"--keys {a.keys}: every count must lie within [1, {len(NAMES)}]")
    for name in ("buckets", "max_docs", "needle_samples"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    try:  # before anything reads it: each process checks a checkpoint whole (a Hugging Face folder has no manifest)
        if weights_kind(a.checkpoint) != "hf":
            verify_checkpoint(a.checkpoint, "--checkpoint")
    except (OSError, ValueError) as e:
        raise SystemExit(f"eval_long: {e}") from e
    return a, overrides


def read_documents(paths: str, tokenizer) -> list[list[int]]:
    """Every document of the comma-separated ``paths`` as token ids (no BOS/EOS): a folder's
    .txt/.jsonl/.parquet files as training reads them; a file of another kind (.md, ...) is one text."""
    docs = []
    for path in paths.split(","):
        if os.path.isfile(path) and not path.endswith((".txt", ".jsonl", ".parquet")):
            with open(path, encoding="utf-8") as f:
                docs.append(list(tokenizer.encode(f.read(), False, False)))
            continue
        for item in work_items(list_files(path, "--data")):
            for where, row in read_rows(item):
                docs.append(list(tokenizer.encode(text_field(where, row) if not isinstance(row, str) else row,
                                                  False, False)))
    return docs


def loss_windows(docs, tokenizer, seq_len: int, max_docs: int) -> torch.Tensor:
    """``[n, seq_len + 1]``: BOS and the start of each document long enough to fill a window."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    rows = [bos + d[:seq_len + 1 - len(bos)] for d in docs if len(bos) + len(d) >= seq_len + 1][:max_docs]
    if not rows:
        longest = max((len(d) for d in docs), default=0)
        raise SystemExit(f"eval_long: no document of --data has {seq_len + 1} tokens (the longest has {longest}); "
                         f"give longer documents or a shorter --seq-len")
    return torch.tensor(rows)


def needle_window(tokenizer, filler: list[int], seq_len: int, keys: int, sample: int):
    """Tokens ``[seq_len + 1]`` and the index of the first answer token: ``keys`` pass-key
    sentences spread over real text, then the question about one of them."""
    rng = random.Random(f"eval_long:{seq_len}:{keys}:{sample}")
    names = rng.sample(NAMES, keys)
    values = [rng.randrange(10_000, 100_000) for _ in names]
    asked = rng.randrange(keys)
    enc = lambda text: list(tokenizer.encode(text, False, False))  # noqa: E731
    needles = [enc(f" The pass key of {n} is {v}. Remember it. ") for n, v in zip(names, values)]
    question = enc(f" What is the pass key of {names[asked]}? The pass key of {names[asked]} is")
    answer = enc(f" {values[asked]}")
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    room = seq_len + 1 - len(bos) - sum(map(len, needles)) - len(question) - len(answer)
    if room < keys:
        raise SystemExit(f"eval_long: --seq-len {seq_len} is too short for {keys} needle(s) and the question")
    start = rng.randrange(max(len(filler) - room, 0) + 1)
    text = (filler * (room // max(len(filler), 1) + 2))[start:start + room]
    cuts = sorted(rng.sample(range(room), keys))  # where each needle goes into the text
    tokens, at = list(bos), 0
    for cut, needle in zip(cuts, needles):
        tokens += text[at:cut] + needle
        at = cut
    tokens += text[at:] + question
    return tokens + answer, len(tokens)


@torch.no_grad()
def token_losses(model, pd, tokens: torch.Tensor, labels: torch.Tensor, pad_id: int, device):
    """Per-token NLL and greedy hits ``[n, S]`` of full windows, computed at the training layout
    (every rank returns the full arrays: sp/cp ranks hold different positions, dp ranks different rows)."""
    dp_mesh, sp_mesh, cp_mesh = pd.get_mesh("dp"), pd.get_mesh("sp"), pd.get_mesh("cp")
    n, s = tokens.shape
    nll = torch.zeros(n, s, device=device)
    hit = torch.zeros(n, s, device=device)
    for row in range(n):
        mine = row % dp_mesh.size() == dp_mesh.get_local_rank()
        b = shard_batch(tokens[row:row + 1], labels[row:row + 1], sp_mesh.get_local_rank(), sp_mesh.size(),
                        pad_token=pad_id, cp_rank=cp_mesh.get_local_rank(), cp=cp_mesh.size())
        logits = model(b.tokens.to(device), positions=b.positions.to(device))  # [1, S/(sp cp), V]
        if not mine:
            continue  # its dp group evaluates the row; this rank joined the collectives of its sp/cp group
        lab = b.labels.to(device)
        keep = (lab != IGNORE_INDEX) & (b.positions.to(device) < s)  # [1, S/(sp cp)]
        pos = b.positions.to(device)[keep]
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), lab, ignore_index=IGNORE_INDEX,
                                               reduction="none")
        nll[row, pos] = ce[keep]
        hit[row, pos] = (logits.argmax(-1) == lab)[keep].float()
    for t in (nll, hit):
        dist.all_reduce(t)
    return nll / pd.tp, hit / pd.tp  # tp ranks all hold the same logits


def loss_by_position(model, pd, windows, n_buckets: int, pad_id: int, device) -> dict:
    tokens, labels = windows[:, :-1], windows[:, 1:]
    nll, _ = token_losses(model, pd, tokens, labels, pad_id, device)
    s = tokens.shape[1]
    edges = [round(i * s / n_buckets) for i in range(n_buckets + 1)]
    loss = [nll[:, lo:hi].mean().item() for lo, hi in zip(edges, edges[1:])]
    return {"documents": tokens.shape[0], "bucket_starts": edges[:-1], "bucket_ends": edges[1:], "loss": loss,
            "mean_loss": nll.mean().item()}


def needles(model, pd, tokenizer, filler, seq_len: int, keys: list[int], samples: int, device) -> dict:
    out = {"keys": keys, "retrieved": [], "token_accuracy": [], "answer_nll": []}
    for k in keys:
        rows, starts = zip(*(needle_window(tokenizer, filler, seq_len, k, i) for i in range(samples)))
        t = torch.tensor(rows)
        tokens, labels = t[:, :-1], t[:, 1:].clone()
        answer = torch.zeros_like(labels, dtype=torch.bool)
        for r, start in enumerate(starts):
            answer[r, start - 1:] = True  # position p predicts token p + 1
        labels[~answer] = IGNORE_INDEX
        nll, hit = token_losses(model, pd, tokens, labels, tokenizer.pad_id, device)
        answer = answer.to(device)
        per_sample = [(hit[r][answer[r]] == 1).all().item() for r in range(samples)]
        out["retrieved"].append(sum(per_sample) / samples)
        out["token_accuracy"].append(hit[answer].mean().item())
        out["answer_nll"].append(nll[answer].mean().item())
    return out


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    lp = result["loss_by_position"]
    centers = [(a + b) / 2 for a, b in zip(lp["bucket_starts"], lp["bucket_ends"])]
    left.plot(centers, lp["loss"], "o-", gid="loss_by_position")
    left.set_xlabel("position in the window (tokens)")
    left.set_ylabel("held-out loss")
    left.set_title(f"loss by position, {lp['documents']} documents at {result['seq_len']} tokens", fontsize=9)
    n = result["needles"]
    x = range(len(n["keys"]))
    right.bar([i - 0.2 for i in x], n["retrieved"], width=0.4, label="retrieved (every answer token)", gid="retrieved")
    right.bar([i + 0.2 for i in x], n["token_accuracy"], width=0.4, label="answer-token accuracy",
              gid="token_accuracy")
    right.set_xticks(list(x), [str(k) for k in n["keys"]])
    right.set_ylim(0, 1)
    right.set_xlabel("pass keys in the window")
    right.legend(fontsize=8)
    right.set_title(f"needles in real text, {result['needle_samples']} windows each", fontsize=9)
    fig.suptitle(f"{os.path.basename(result['checkpoint'].rstrip('/'))}, layout {result['layout']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare(a, overrides: list[str], world: int):
    """(config, spec, layout) before any process group: the run's spec as train.py resolves it, with the
    checkpoint's record (its RoPE, its hf_assets/); a ConfigError naming a refusal."""
    config = load_config(["--config", a.config, *overrides])
    config.training.seq_len = a.seq_len or config.training.seq_len
    spec = resolve_run(config, start=a.checkpoint)
    return config, spec, validate(config, world, spec)


def main(argv=None) -> int:
    a, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, spec, pd = prepare(a, overrides, world)
        seq_len = config.training.seq_len
        tokenizer, args = spec.tokenizer_object, spec.args
        check_weights(a.checkpoint, args)
        docs = read_documents(a.data, tokenizer)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"eval_long: {e}") from e
    windows = loss_windows(docs, tokenizer, seq_len, a.max_docs)  # refusals before any process group
    filler = [t for d in docs for t in d]
    for k in a.keys:
        needle_window(tokenizer, filler, seq_len, k, 0)
    device = init_distributed()
    pd.build_mesh(device.type)
    model = load_eval_model(args, ComputeOptions.from_config(config.model), pd, device, a.checkpoint)
    result = {"checkpoint": a.checkpoint, "config": a.config, "overrides": overrides, "data": a.data,
              "layout": pd.degrees, "seq_len": seq_len, "needle_samples": a.needle_samples,
              "rope_theta": args.rope_theta,
              "rope_scaling": dataclasses.asdict(args.rope_scaling) if args.rope_scaling else None,
              "loss_by_position": loss_by_position(model, pd, windows, a.buckets, tokenizer.pad_id, device),
              "needles": needles(model, pd, tokenizer, filler, seq_len, a.keys, a.needle_samples, device)}
    if dist.get_rank() == 0:
        for note in (*spec.notes, *(f"override: {o}" for o in spec.overrides)):
            print(f"note: {note}", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
        with open(a.output + ".json", "w") as f:
            json.dump(result, f, indent=1)
        draw(result, a.output + ".png")
        lp, nd = result["loss_by_position"], result["needles"]
        print("loss by position: " + "  ".join(f"{lo}-{hi} {v:.3f}" for lo, hi, v in
                                               zip(lp["bucket_starts"], lp["bucket_ends"], lp["loss"])))
        print("needles: " + "  ".join(f"{k} key(s) {r:.2f} retrieved (answer-token accuracy {t:.2f})"
                                      for k, r, t in zip(nd["keys"], nd["retrieved"], nd["token_accuracy"])))
        print(f"wrote {a.output}.json and {a.output}.png")
    return 0  # the process group is left by cli (distributed/setup.py's leave_job)


def cli() -> None:
    """The installed command (pyproject.toml's [project.scripts]); never returns."""
    leave_job(main())


if __name__ == "__main__":
    cli()
