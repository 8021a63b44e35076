"""A plain PyTorch training loop: a transformers AutoModelForCausalLM with Ulysses (sp) x FSDP2 (dp).

    torchrun --nproc-per-node 2 examples/hf_loop.py --dp 1 --sp 2 --text README.md --output outputs/hf_loop

The text file is cut into documents at blank lines, byte-level tokens (no tokenizer to
download), and the documents are packed into rows of ``--seq-len`` tokens with positions
restarting at 0 at each document, as transformers' DataCollatorWithFlattening packs them:
attention stays within a document. Each dp rank takes its rows of the step; each sp rank of
it holds ``seq_len / sp`` tokens of every row (``shard_batch``), attention runs over the full
row behind Ulysses' all-to-all (``apply_ulysses``), and ``sp_loss`` makes the loss the token
mean of the whole step. The model is a small Llama built from a config (any decoder that
uses transformers' attention interface works the same). At the end rank 0 writes the model
with ``save_pretrained`` and checks that transformers reloads it to the same loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch, sp_loss

OFFSET = 3  # ids 0, 1, 2: pad, bos, eos; byte b is id b + 3


def packed_rows(path: str, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids), both [N, seq_len]: the file's paragraphs as documents, packed."""
    text = open(path, encoding="utf-8").read()
    ids, positions = [], []
    for doc in (d for d in text.split("\n\n") if d.strip()):
        tokens = [1] + [b + OFFSET for b in doc.encode("utf-8")] + [2]
        ids += tokens
        positions += range(len(tokens))
    n = len(ids) // seq_len
    return (torch.tensor(ids[:n * seq_len]).view(n, seq_len),
            torch.tensor(positions[:n * seq_len]).view(n, seq_len))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--text", default="README.md")
    p.add_argument("--output", default="outputs/hf_loop")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="rows per step, over all dp ranks")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (args.dp, args.sp), mesh_dim_names=("dp", "sp"))
    rank = dist.get_rank()

    config = AutoConfig.for_model("llama", vocab_size=256 + OFFSET, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=args.seq_len, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_config(config).to(device)
    apply_ulysses(model, mesh)  # before fully_shard: attention becomes Ulysses over the "sp" dim
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh))  # every rank: sp ranks hold the same weights
    fully_shard(model, mesh=fsdp_mesh(mesh))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    ids, positions = packed_rows(args.text, args.seq_len)
    dp_rank, rows = mesh["dp"].get_local_rank(), args.batch // args.dp
    first = last = None
    for step in range(1, args.steps + 1):
        start = ((step - 1) * args.batch) % (len(ids) - args.batch + 1) + dp_rank * rows
        batch = {"input_ids": ids[start:start + rows], "position_ids": positions[start:start + rows]}
        local = {k: v.to(device) for k, v in shard_batch(batch, mesh).items()}  # [rows, seq_len / sp] each
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        loss = sp_loss(out.logits, local["shift_labels"], mesh)  # the step's token mean, on every rank
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        first = first if first is not None else loss.item()
        last = loss.item()
        if rank == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {last:.4f}", flush=True)

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        plain.load_state_dict(state)
        plain.save_pretrained(args.output)
        reloaded = AutoModelForCausalLM.from_pretrained(args.output, dtype=torch.float32)
        batch = ids[:rows]
        with torch.no_grad():
            logits = reloaded(input_ids=batch, position_ids=positions[:rows]).logits
        shift = torch.nn.functional.pad(batch[:, 1:], (0, 1), value=-100)
        check = torch.nn.functional.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
        print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps; saved {args.output} "
              f"({reloaded.config.model_type}, attention {reloaded.config._attn_implementation}); "
              f"reloaded loss on the first rows {check.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
