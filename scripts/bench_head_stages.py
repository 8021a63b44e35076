"""Tokens/s of head-staged attention against plain attention: paired runs of one transformer block.

    python scripts/bench_head_stages.py --stages 4 --seq-len 4096 --repeats 5

One process (no exchange: what is timed is the stages' extra work, not the network), one block
of Llama-3-8B's head layout scaled down (``--dim``; 32 q heads, 8 kv heads), forward and
backward under ``--ac`` (full by default, as the long-context configs run), plain and staged
alternately ``--repeats`` times on the same input, so that both see the same machine load.
Prints the median time of each and their ratio (staged / plain; above 1 = slower). Staging
recomputes each stage's attention forward in backward (its checkpoint), which is where any
cost comes from.
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
    p.add_argument("--ac", choices=("none", "full"), default="full")
    a = p.parse_args(argv)

    from titan_ulysses.distributed.activation_checkpoint import apply_ac
    from titan_ulysses.distributed.staged_attention import apply_head_stages, check_head_stages
    from titan_ulysses.models.llama.args import get_flavor
    from titan_ulysses.models.llama.model import Transformer

    torch.manual_seed(0)
    args = get_flavor("8B", n_layers=1, dim=a.dim, n_heads=32, n_kv_heads=8, ffn_hidden_dim=int(3.5 * a.dim),
                      vocab_size=1024)
    check_head_stages(a.stages, args.n_heads, args.n_kv_heads, 1)
    plain = Transformer(args)
    plain.init_weights()
    staged = copy.deepcopy(plain)
    apply_head_stages(staged, a.stages)
    for model in (plain, staged):
        apply_ac(model, a.ac)
    x = torch.randn(1, a.seq_len, a.dim)
    rope = plain.rope(torch.arange(a.seq_len))

    def run(model) -> float:
        xi = x.clone().requires_grad_()
        t = time.perf_counter()
        model.layers["0"](xi, rope).sum().backward()
        return time.perf_counter() - t

    run(plain), run(staged)  # warm-up
    times = {"plain": [], "staged": []}
    for _ in range(a.repeats):
        times["plain"].append(run(plain))
        times["staged"].append(run(staged))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [s / q for s, q in zip(times["staged"], times["plain"])]
    print(f"one block, dim {a.dim}, 32 heads / 8 kv heads, {a.seq_len} tokens, AC {a.ac}, {a.stages} stages, "
          f"{torch.get_num_threads()} threads, {a.repeats} paired repeats")
    print(f"plain  median {med['plain']:.3f} s   staged median {med['staged']:.3f} s")
    print(f"staged / plain: median of pairs {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); tokens/s cost {100 * (1 - 1 / statistics.median(ratios)):+.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
