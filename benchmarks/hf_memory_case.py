"""The GPU suite's case ``hf_memory_bf16`` (parts ``rest`` and ``bench``): the transformers integration's memory options
on CUDA in bf16.

Runs ``scripts/bench_hf_memory.py --device cuda --dtype bfloat16`` (2 gloo ranks sharing GPU 0, sp=2, FSDP2
mixed precision; the fused loss at its automatic chunk) and records each row's bytes per local token (saved by
autograd, and of the step's peak) and its peaks at both lengths. It passes when every option lowers the peak at
the longer length below that of the row it is added to (``LOWER``: measured against measured, no figure written down). Without
the fused loss the logits make the peak, so the tiled MLP is judged alone without checkpointing and on top of the
fused loss with it. The CPU dry run checks the plumbing at toy sizes, where a fixed cost (FSDP's reduce of the
output layer's gradients at the end of the backward) can be the whole peak: it records, it does not judge.
"""

from __future__ import annotations

import sys

from benchmarks.gpu_common import tagged_json

HF = "apply_ulysses: "
LOWER = [  # (row with the option, the row it is added to, gradient checkpointing)
    ("fused loss", "no option", False), ("fused loss", "no option", True),
    ("tiled MLP", "no option", False),
    ("fused loss + tiled MLP", "fused loss", False), ("fused loss + tiled MLP", "fused loss", True),
    ("+ head stages 2", "fused loss + tiled MLP", False),  # with checkpointing: recorded (the loss may set that peak)
]
"""Each option's peak (at the longer length) must be below its base row's."""


def hf_memory_bf16(ctx):
    if ctx.dry_run:  # toy sizes on CPU: the plumbing (2 layers, 4000 tokens of vocabulary, short tiles and chunks)
        sizes = ["--seq", "128", "256", "--vocab", "4000", "--layers", "2", "--tile", "32", "--chunk", "32"]
    else:  # local slices of 16K and 32K tokens: the activations, not the fixed costs, make the peak
        sizes = ["--seq", "32768", "65536", "--device", "cuda", "--dtype", "bfloat16", "--chunk", "0", "--tile", "4096"]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "scripts/bench_hf_memory.py", "--json", *sizes]
    res, why = tagged_json(argv, "HF_MEMORY", ctx.timeout(400))
    if res is None:
        return {"status": "fail", "detail": why[-300:]}
    peak = {(r["row"], r["checkpointing"]): r["peak_mib"] for r in res["rows"]}
    figures = {f"{r['row']}{', GC/AC' if r['checkpointing'] else ''}":
               f"{r['saved_kib']:.1f} / {r['peak_kib']:.1f} / {r['peak_mib_short']:.0f} / {r['peak_mib']:.0f}"
               for r in res["rows"]}
    failed = [f"{option} ({'GC' if gc else 'no GC'}) {peak[HF + option, gc]:.0f} >= {base} "
              f"{peak[HF + base, gc]:.0f} MiB"
              for option, base, gc in LOWER if peak[HF + option, gc] >= peak[HF + base, gc]]
    detail = (f"scripts/bench_hf_memory.py {' '.join(sizes)} on {res['device']}, {res['dtype']}: KiB per local token "
              f"saved by autograd / of the step's peak, between S={res['seq'][0]} and S={res['seq'][1]}; then the "
              f"peaks in MiB at each")
    if ctx.dry_run:
        return {"status": "measured", "figures": figures, "detail": detail + "; toy sizes: recorded, not judged"}
    return {"status": "fail" if failed else "pass", "figures": figures,
            "detail": detail + (f"; not lower: {'; '.join(failed)}" if failed else "; every option lowers the peak")}
