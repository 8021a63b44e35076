"""Tokens/s of head-staged attention against plain attention: paired runs of one transformer block.

    python scripts/bench_head_stages.py --stages 4 --seq-len 4096 --repeats 5 --ac full

One process (no exchange: what is timed is the stages' extra work, not the network), one block
of Llama-3-8B's head layout scaled down (``--dim``; 32 q heads, 8 kv heads), forward and
backward under ``--ac`` (none, selective, or full as the long-context configs run). Three
variants run in turn ``--repeats`` times on the same input, so that all see the same machine
load: plain attention, stages that keep their attention kernel's outputs
(``ulysses_stage_keep_attention = true``, the default) and stages that recompute the kernel
too (``false``). Prints the median time of each and each staged variant's ratio to plain in
the same repeat (above 1 = slower). Each stage is a checkpoint that recomputes its projections,
RoPE and (with sp > 1) exchanges in backward; without keeping, its attention kernel as well.
On a shared machine use ``--threads 1`` (and ``--clock process``): with more threads than free
cores every op waits for its slowest thread, and the stages' four times as many (smaller) ops
pay that wait four times as often, which is the machine's load, not the stages' work.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ac", choices=("none", "selective", "full"), default="full")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="process: this process's CPU time (steadier than wall time on a shared machine)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args(argv)

    from titan_ulysses.distributed.activation_checkpoint import apply_ac
    from titan_ulysses.distributed.staged_attention import apply_head_stages, check_head_stages
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.models.flavors import get_flavor

    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    torch.manual_seed(0)
    args = get_flavor("8B", n_layers=1, dim=a.dim, n_heads=32, n_kv_heads=8, ffn_hidden_dim=int(3.5 * a.dim),
                      vocab_size=1024)
    check_head_stages(a.stages, args.n_heads, args.n_kv_heads, 1)
    plain = Transformer(args)
    plain.init_weights()
    models = {"plain": plain}
    for name, keep in (("kept", True), ("recomputed", False)):
        models[name] = copy.deepcopy(plain)
        apply_head_stages(models[name], a.stages, keep)
    for model in models.values():
        apply_ac(model, a.ac)
    x = torch.randn(1, a.seq_len, a.dim)
    rope = plain.rope(torch.arange(a.seq_len))

    def run(model) -> float:
        xi = x.clone().requires_grad_()
        t = clock()
        model.layers["0"](xi, rope).sum().backward()
        return clock() - t

    for model in models.values():  # warm-up
        run(model)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(a.repeats):
        for name in names[r % 3:] + names[:r % 3]:  # each variant first in turn: no place in the order favoured
            times[name].append(run(models[name]))
    print(f"one block, dim {a.dim}, 32 heads / 8 kv heads, {a.seq_len} tokens, AC {a.ac}, {a.stages} stages, "
          f"{torch.get_num_threads()} threads, {a.repeats} paired repeats, {a.clock} time, device cpu")
    print("   ".join(f"{name} median {statistics.median(t):.3f} s" for name, t in times.items()))
    for name in ("kept", "recomputed"):
        ratios = [s / q for s, q in zip(times[name], times["plain"])]
        med = statistics.median(ratios)
        print(f"staged {name:<10} / plain: median of pairs {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"tokens/s cost {100 * (1 - 1 / med):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
