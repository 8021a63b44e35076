"""Memory per local token of one forward+backward step: a transformers model under apply_ulysses, with and
without its memory options, beside train.py's decoder.

    torchrun --nproc-per-node 2 scripts/bench_hf_memory.py                                  # CPU, fp32
    torchrun --nproc-per-node 2 scripts/bench_hf_memory.py --device cuda --dtype bfloat16   # ranks sharing GPU 0

Both paths run the same Llama shape (a tiny config saved as a Hugging Face folder) at sp=2 over gloo
(every rank holds S/2 tokens), under FSDP2 over every rank, one forward with the loss and its
backward. Two figures per row, each taken at two sequence lengths and differenced over this
rank's tokens, so parameters, gradients and other fixed costs drop out (bytes per local token):
- saved: the bytes of every tensor autograd saves for the backward (unique storages, through
  ``torch.autograd.graph.saved_tensors_hooks``);
- peak: the step's peak memory. On CPU PyTorch's ``MemTracker`` (``torch.distributed._tools``:
  every storage the step's ops hold at once); on CUDA ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats`` (a warm-up step first: the fused loss compiles on first use).
Rows: ``HF_ROWS``, ``apply_ulysses`` keyword arguments, each without and with transformers'
``gradient_checkpointing_enable`` (GC), and train.py's own (``OURS_ROWS``; AC: ``ac_mode full``). The
peaks themselves are printed beside: where a row's peak is the same at both lengths it is a fixed cost (at
short lengths FSDP's reduce of the embedding and output-layer gradients at the end of the backward), and where
the shorter length's peak is that cost the per-token figure understates the row. A peak inside the backward,
with part of what was saved already freed, can grow more slowly than the saved bytes. ``--json``
adds one ``HF_MEMORY {...}`` line (the GPU suite's case ``hf_memory_bf16`` reads it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

HF_ROWS: dict[str, dict] = {
    "no option": {},
    "tiled MLP": {"mlp_tile_size": "TILE"},
    "fused loss": {"fused_loss": True, "loss_chunk_size": "CHUNK"},
    "fused loss + tiled MLP": {"fused_loss": True, "loss_chunk_size": "CHUNK", "mlp_tile_size": "TILE"},
    "+ head stages 2": {"fused_loss": True, "loss_chunk_size": "CHUNK", "mlp_tile_size": "TILE", "head_stages": 2},
}
"""Row name -> apply_ulysses keyword arguments ("TILE": ``--tile``, "CHUNK": ``--chunk``); each runs without and
with gradient checkpointing."""
OURS_ROWS: list[tuple[str, str, dict]] = [
    # (name, ac_mode, ComputeOptions fields)
    ("no option", "none", {"loss_backend": "materialized"}),
    ("no option", "full", {"loss_backend": "materialized"}),
    ("fused loss + tiled MLP", "full", {"loss_backend": "fused", "loss_chunk_size": "CHUNK", "mlp_tile_size": "TILE"}),
]
"""train.py's decoder on the same weights: its activation checkpointing and memory switches."""


class SavedBytes:
    """Bytes of the distinct storages autograd saves while open.

    Keyed by the storage itself (``_cdata``), not its address: FSDP2 frees a layer's gathered weights
    after its forward (a saved tensor's storage resized to 0), and a later activation may take the address."""

    def __init__(self):
        self.seen: dict[int, int] = {}

    def pack(self, t):
        try:
            storage = t.untyped_storage()
            self.seen[storage._cdata] = storage.nbytes()
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


def measure(step, model, device: torch.device) -> tuple[int, int]:
    """(saved bytes, peak bytes) of ``step()`` (a forward with the loss, then its backward)."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        step(SavedBytes())  # warm-up: the fused loss's compiled pass, FSDP's lazy init, the allocator's pools
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        saved = step(SavedBytes())
        torch.cuda.synchronize(device)
        return saved, torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        saved = step(SavedBytes())
    return saved, tracker.get_tracker_snapshot("peak")[device]["Total"]


def _resolve(options: dict, sizes: dict) -> dict:
    return {k: sizes.get(v, v) if isinstance(v, str) else v for k, v in options.items()}


def ours(folder: str, seqs: list[int], ac: str, compute: dict, device: torch.device, dtype) -> list[tuple[int, int]]:
    from titan_ulysses.data.sharding import shard_batch as shard
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
    from titan_ulysses.models.registry import build_model

    pd = ParallelDims(sp=dist.get_world_size(), world_size=dist.get_world_size())
    pd.build_mesh(device.type)
    with torch.device("meta"):
        model = build_model(load_hf_args(folder), ComputeOptions(**compute))
    parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=dtype, ac_mode=ac))
    model.to_empty(device=device)
    model.init_buffers()
    load_hf_weights(model, folder)
    sp = pd.get_mesh("sp")
    out = []
    for seq in seqs:
        tokens = torch.randint(0, 1000, (1, seq))
        batch = shard(tokens, tokens, sp.get_local_rank(), sp.size())

        def step(saved):
            with saved:
                loss = model(batch.tokens.to(device), positions=batch.positions.to(device),
                             labels=batch.labels.to(device))
            loss.backward()
            return saved.total

        out.append(measure(step, model, device))
    return out


def theirs(folder: str, seqs: list[int], gc: bool, options: dict, device: torch.device, dtype) -> list[tuple[int, int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from titan_ulysses.integrations.transformers import apply_ulysses, fsdp_mesh, shard_batch, sp_loss

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("sp",))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").to(device)
    apply_ulysses(model, mesh, **options)
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)  # as train.py's param_dtype
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh(mesh), mp_policy=policy)
    fully_shard(model, mesh=fsdp_mesh(mesh), mp_policy=policy)
    out = []
    for seq in seqs:
        local = {k: v.to(device) for k, v in shard_batch({"input_ids": torch.randint(0, 1000, (1, seq))}, mesh).items()}
        labels = local["shift_labels"]

        def step(saved):
            with saved:
                if options.get("fused_loss"):  # .loss: this rank's token mean, no logits
                    output = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                                   shift_labels=labels).loss
                else:
                    output = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                loss = sp_loss(output, labels, mesh)
            loss.backward()
            return saved.total

        out.append(measure(step, model, device))
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs=2, default=[4096, 8192], help="the two sequence lengths")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=256, help="hidden size (heads of 32; MLP 3x)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tile", type=int, default=256, help="mlp_tile_size of the tiled-MLP rows")
    p.add_argument("--chunk", type=int, default=64,
                   help="loss_chunk_size of the fused-loss rows (0: automatic, which at these lengths is the whole "
                        "slice: its floor is 2^26 logits, 2048 rows at vocab 32000)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every rank on GPU 0 (gloo ranks sharing it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the compute dtype (FSDP2 mixed precision; the weights stay fp32)")
    p.add_argument("--json", action="store_true", help="also print one HF_MEMORY {...} line")
    args = p.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible; run on CPU (--device cpu)")
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = os.path.join(tempfile.gettempdir(), f"bench_hf_memory_{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}")
    if dist.get_rank() == 0:
        config = LlamaConfig(hidden_size=args.dim, intermediate_size=3 * args.dim, num_hidden_layers=args.layers,
                             num_attention_heads=args.dim // 32, num_key_value_heads=max(2, args.dim // 128),
                             vocab_size=args.vocab, max_position_embeddings=max(args.seq))
        LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    sp, rank0 = dist.get_world_size(), dist.get_rank() == 0
    tokens = (args.seq[1] - args.seq[0]) / sp
    peak_tool = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "MemTracker"
    if rank0:
        print(f"device {device_name(device)}, torch {torch.__version__}, {sp} gloo ranks at sp={sp}, FSDP2; Llama dim "
              f"{args.dim}, {args.layers} layers, vocab {args.vocab}, {args.dtype}; per local token between "
              f"S={args.seq[0]} and S={args.seq[1]}: saved (autograd) and peak ({peak_tool}), KiB", flush=True)
        print(f"{'row':37s} {'GC/AC':5s} {'saved':>6s} {'peak':>6s}  peak MiB at S={args.seq[0]}, {args.seq[1]}",
              flush=True)
    rows, sizes = [], {"TILE": args.tile, "CHUNK": args.chunk}
    jobs = [(f"apply_ulysses: {name}", gc, theirs, gc, _resolve(opts, sizes))
            for gc in (False, True) for name, opts in HF_ROWS.items()]
    jobs += [(f"train.py: {name}", ac != "none", ours, ac, _resolve(compute, sizes)) for name, ac, compute in OURS_ROWS]
    for name, checkpointed, fn, mode, options in jobs:
        (saved_a, peak_a), (saved_b, peak_b) = fn(folder, args.seq, mode, options, device, dtype)
        row = {"row": name, "checkpointing": checkpointed, "options": options,
               "saved_kib": (saved_b - saved_a) / tokens / 1024, "peak_kib": (peak_b - peak_a) / tokens / 1024,
               "peak_mib": peak_b / 2**20, "peak_mib_short": peak_a / 2**20}
        rows.append(row)
        if rank0:
            print(f"{name:37s} {'on' if checkpointed else 'off':5s} {row['saved_kib']:6.1f} {row['peak_kib']:6.1f}"
                  f" {row['peak_mib_short']:8.1f} {row['peak_mib']:8.1f}", flush=True)
    if rank0 and args.json:
        print("HF_MEMORY " + json.dumps({"device": device_name(device), "dtype": args.dtype, "seq": args.seq,
                                          "rows": rows}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
