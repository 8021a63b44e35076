"""Peak host memory per rank while loading a Hugging Face folder sharded (FSDP over all ranks).

    python scripts/bench_hf_load.py --nproc 4 [--hf-folder DIR | --dim 2048 --layers 8 ...]

Without --hf-folder a random Llama-shaped folder (bf16, several safetensors files and an
index, as on the Hub) is written to --workdir first. Each of --nproc gloo processes builds
the model on the meta device, shards it with FSDP2 over all ranks (dp_shard = nproc),
allocates its shard, then loads the folder with ``load_hf_weights``. Printed per rank:
RSS before the load (interpreter, torch and the rank's fp32 shard, already touched), the
peak during it (``ru_maxrss``) and the growth (what loading itself costs: slices read out
of the memory-mapped files, DCP's plans, one gathered q/k tensor at a time), against the
sizes of the rank's shard and of the whole model in fp32. A rank that materialised the
model would grow by at least the full-model figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from titan_ulysses.interop.hf_adapter import expected_hf_shapes  # noqa: E402
from titan_ulysses.interop.hf_export import hf_config  # noqa: E402
from titan_ulysses.models.decoder.args import DecoderArgs  # noqa: E402
from titan_ulysses.models.registry import num_params

GIB = 2**30


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux


def write_random_folder(folder: str, args: DecoderArgs, shard_bytes: int = 256 * 2**20) -> None:
    """A Llama folder of random bf16 weights, written one safetensors shard at a time."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    shapes = expected_hf_shapes(args)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        n = torch.Size(shape).numel() * 2
        if current and size + n > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    groups.append(current)
    weight_map = {}
    g = torch.Generator().manual_seed(0)
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: (0.02 * torch.randn(shapes[k], generator=g)).to(torch.bfloat16) for k in names},
                  os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(args, torch.bfloat16), f, indent=2)


def _rank(rank: int, world: int, init_file: str, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from titan_ulysses.interop.hf_weights import load_hf_weights
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
    from titan_ulysses.interop.hf_config import load_hf_args
    from titan_ulysses.models.registry import build_model, parallelize_model

    args = load_hf_args(folder)
    pd = ParallelDims(dp_shard=world, world_size=world)
    pd.build_mesh("cpu")
    with torch.device("meta"):
        model = build_model(args)
    parallelize_model(model, pd, ParallelizeOptions(param_dtype=torch.float32))
    model.to_empty(device="cpu")
    model.init_buffers()
    with torch.no_grad():  # touch the shard, so that "before" holds it and the growth is the load's own
        for param in model.parameters():
            param.zero_()
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    dist.barrier()
    before, t0 = _rss_gib(), time.perf_counter()
    load_hf_weights(model, folder)
    seconds = time.perf_counter() - t0
    dist.barrier()
    result = {"rank": rank, "rss_before_gib": before, "peak_gib": _peak_gib(), "shard_gib": shard / GIB,
              "seconds": seconds}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--hf-folder", default="", help="an existing Hugging Face folder (default: write a random one)")
    p.add_argument("--workdir", default="", help="where the random folder goes (default: a temporary folder)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.workdir or None) as tmp:
        folder = a.hf_folder
        if not folder:
            folder = os.path.join(tmp, "hf")
            args = DecoderArgs(dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                             ffn_hidden_dim=a.ffn, vocab_size=a.vocab, rope_scaling=None)
            write_random_folder(folder, args)
        from titan_ulysses.interop.hf_config import load_hf_args

        args = load_hf_args(folder)
        files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in files) / GIB
        full_fp32 = num_params(args) * 4 / GIB
        mp.spawn(_rank, args=(a.nproc, os.path.join(tmp, "store"), folder, tmp), nprocs=a.nproc)
        rows = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(a.nproc)]
    print(f"device: cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo, "
          f"{a.nproc} ranks, FSDP2 dp_shard={a.nproc}; torch {torch.__version__}")
    print(f"model: {num_params(args) / 1e6:.0f}M params, {len(files)} safetensors files, {on_disk:.2f} GiB on disk "
          f"(bf16); {full_fp32:.2f} GiB in fp32")
    print("rank | shard fp32 GiB | RSS before load GiB | peak RSS GiB | growth GiB | load s")
    for r in rows:
        print(f"{r['rank']:4d} | {r['shard_gib']:14.2f} | {r['rss_before_gib']:19.2f} | {r['peak_gib']:12.2f} | "
              f"{r['peak_gib'] - r['rss_before_gib']:10.2f} | {r['seconds']:6.1f}")
    worst = max(r["peak_gib"] - r["rss_before_gib"] for r in rows)
    print(f"largest growth while loading: {worst:.2f} GiB per rank = {worst / full_fp32:.2f} x the fp32 model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
