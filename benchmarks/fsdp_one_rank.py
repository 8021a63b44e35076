"""FSDP2 on one rank against the plain module it wraps: what its per-layer casts and copies cost.

    python -m benchmarks.fsdp_one_rank '{"flavor": "1B", "n_layers": 4, "seq_len": 16384, "steps": 5, "warmup": 2}'

Our decoder (``flavor`` cut to ``n_layers``, eager, sdpa) trained one sequence a step both ways, in
one process of a world of one (nccl on CUDA, gloo on CPU):

* ``fsdp``: ``parallelize_decoder`` as train.py runs a one-GPU job (FSDP2 per block and root,
  bf16 parameters gathered from fp32 shards, fp32 gradient reduction);
* ``plain``: the same model unwrapped, fp32 weights under bf16 autocast (what FSDP's mixed
  precision replaces), the loss in the model as train.py computes it.

Both with torch's AdamW (fused on CUDA); steps timed whole (a ``loss.item()`` ends each), the
first ``warmup`` dropped, medians. Prints ``FSDP1 {json}``. The ``perf`` part's ``fsdp_one_rank``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _steps(model, step_input, n: int, cuda: bool, autocast: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens, labels = step_input
    times = []
    for _ in range(n):
        start = time.perf_counter()
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times


def main(spec: dict) -> dict:
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder
    from titan_ulysses.models.flavors import get_flavor

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        args = get_flavor(spec["flavor"], n_layers=spec["n_layers"])
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (1, spec["seq_len"] + 1), generator=gen).to(device)
        step_input = (tokens[:, :-1], tokens[:, 1:])  # [1, S] each
        out = {}
        for kind in ("plain", "fsdp"):
            torch.manual_seed(0)
            with torch.device(device):
                model = Transformer(args)
                model.init_weights()
            if kind == "fsdp":
                pd = ParallelDims(world_size=1)
                pd.build_mesh(device.type)
                parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=torch.bfloat16))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = _steps(model, step_input, spec["steps"], cuda, autocast=kind == "plain")
            step_s = statistics.median(times[spec["warmup"]:] or times)
            out[kind] = {"step_s": step_s, "tok_s": spec["seq_len"] / step_s,
                         "peak_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
                         "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            del model
            if cuda:
                torch.cuda.empty_cache()
        out["fsdp_over_plain"] = out["fsdp"]["tok_s"] / out["plain"]["tok_s"]
        return out
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print("FSDP1 " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
    sys.exit(0)
