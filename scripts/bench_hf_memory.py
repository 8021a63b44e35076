"""Activation memory per token on CPU: train.py's decoder vs a transformers model under apply_ulysses.

    torchrun --nproc-per-node 2 scripts/bench_hf_memory.py

Both paths run the same Llama shape (a tiny config saved as a Hugging Face folder) at sp=2
(every rank holds S/2 tokens), one forward with the loss and its backward. What is measured
is the bytes of every tensor autograd saves for the backward (unique storages, through
``torch.autograd.graph.saved_tensors_hooks``): the activation memory a step holds at its
peak. It is measured at two sequence lengths and the difference divided by the difference in
this rank's tokens, so parameters and other fixed costs drop out: bytes per local token.
Rows: no activation checkpointing, full checkpointing per block (ours: ``ac_mode full``;
transformers: ``gradient_checkpointing_enable``), and ours with the fused loss (``loss_backend``) and
``mlp_tile_size`` 256 as the long-context configs set them, and the integration with its
``mlp_tile_size`` option (256). The logits' share grows with the vocabulary;
train.py's fused loss never holds ``[S/sp, vocab]`` logits at once.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist


class SavedBytes:
    """Bytes of the distinct storages autograd saves while open."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def pack(self, t):
        try:
            storage = t.untyped_storage()
            self.seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # no storage of its own to read (a kernel's empty placeholder): count its elements
            self.seen[id(t)] = t.numel() * t.element_size()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def ours(folder: str, seq: int, ac: bool, chunked: bool = False) -> int:
    from titan_ulysses.data.sharding import shard_batch as shard
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
    from titan_ulysses.models.registry import build_model

    pd = ParallelDims(sp=dist.get_world_size(), world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    with torch.device("meta"):
        model = build_model(load_hf_args(folder), ComputeOptions(loss_backend="fused" if chunked else "materialized",
                                                                 mlp_tile_size=256 if chunked else 0))
    parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=torch.float32, ac_mode="full" if ac else "none"))
    model.to_empty(device="cpu")
    model.init_buffers()
    load_hf_weights(model, folder)
    tokens = torch.randint(0, 1000, (1, seq))
    batch = shard(tokens, tokens, pd.get_mesh("sp").get_local_rank(), pd.get_mesh("sp").size())
    with SavedBytes() as saved:
        loss = model(batch.tokens, positions=batch.positions, labels=batch.labels)
    loss.backward()
    return saved.total


def theirs(folder: str, seq: int, ac: bool, tiled: bool = False) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch, sp_loss

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sp",))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    apply_ulysses(model, mesh, mlp_tile_size=256 if tiled else 0)
    if ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh))
    fully_shard(model, mesh=fsdp_mesh(mesh))
    local = shard_batch({"input_ids": torch.randint(0, 1000, (1, seq))}, mesh)
    with SavedBytes() as saved:
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = sp_loss(logits, local["shift_labels"], mesh)
    loss.backward()
    return saved.total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs=2, default=[1024, 2048], help="the two sequence lengths")
    p.add_argument("--vocab", type=int, default=32000)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"bench_hf_memory_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    if dist.get_rank() == 0:
        config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=args.vocab, max_position_embeddings=max(args.seq))
        LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    sp = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"device cpu, {sp} ranks at sp={sp}; Llama dim 256, 4 layers, 8 q / 2 kv heads, vocab {args.vocab}, "
              f"fp32; saved activations per local token between S={args.seq[0]} and S={args.seq[1]}")
    rows = [("train.py decoder", ours, False, {}), ("transformers + apply_ulysses", theirs, False, {}),
            ("train.py decoder", ours, True, {}), ("transformers + apply_ulysses", theirs, True, {}),
            ("train.py, chunked loss + tiled MLP 256", ours, True, {"chunked": True}),
            ("transformers + apply_ulysses, tiled MLP 256", theirs, False, {"tiled": True})]
    for name, fn, ac, extra in rows:
        a, b = (fn(folder, s, ac, **extra) for s in args.seq)
        per_token = (b - a) / ((args.seq[1] - args.seq[0]) / sp)
        if dist.get_rank() == 0:
            print(f"{name:44s} AC {'full' if ac else 'none':4s}: {per_token / 1024:8.1f} KiB/token "
                  f"(saved {a / 2**20:.1f} MiB at S={args.seq[0]}, {b / 2**20:.1f} MiB at S={args.seq[1]})",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
