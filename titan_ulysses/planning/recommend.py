"""Does a config fit the device? The layout and switches that make it fit (pure arithmetic).

``recommend`` is what ``scripts/estimate_memory.py`` prints; the trainer calls
``memory_warning`` at start-up so that a ``seq_len`` far beyond the device is a warning
with that recommendation, not an allocator error minutes later.
"""

from __future__ import annotations

import dataclasses

from titan_ulysses.distributed.heads import is_even
from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import GIB, Layout, Switches, from_config
from titan_ulysses.ops.attention import get_backend

BUDGET = 0.9  # of the device: the rest is the CUDA context, NCCL buffers, fragmentation
DEVICES = (("H100", 80.0), ("H200", 141.0))
"""The GPUs the docs give figures for and their memory in GiB, as the configs' headers name them."""
_AC_STRENGTH = {"none": 0, "selective": 1, "full": 2, "full_offload": 3}


SWITCH_ORDER = [  # (override, Switches change), cumulative, as in docs/memory.md's table
    ("--model.loss_backend fused", {"loss_backend": "fused"}),  # never all the logits (the default)
    ("--model.mlp_tile_size 8192", {"mlp_tile_size": 8192}),
    ("--activation_checkpoint.mode selective", {"ac_mode": "selective"}),
    ("--activation_checkpoint.mode full", {"ac_mode": "full"}),
    ("--activation_checkpoint.mode full_offload", {"ac_mode": "full_offload"}),
    ("--training.enable_cpu_offload true", {"cpu_offload": True}),
]


def recommend(args, layout: Layout, switches: Switches, seq_len, batch, world, budget, attn_backend: str = "sdpa"):
    """The first (sp, switches) that fits ``budget`` bytes: (sp, overrides, estimate) or None.

    The sequence is split over n ranks, smallest n first. Over n ranks an even Ulysses
    split is preferred (its all-to-all moves less than cp's all-gather, and it keeps no
    gathered K/V). Where the heads do not split evenly n ways (``distributed/heads.py``),
    two splits follow: the largest even Ulysses degree combined with context_parallel_degree
    n / sp (every rank does the same attention work), then Ulysses over n ranks with uneven
    head counts (the busiest rank sets the pace, but any backend and document mask works).
    A backend that does not run under context parallelism (the attention registry's ``cp``;
    every registered one does today) takes the uneven split first, and a split with cp > 1
    comes after every split that keeps the backend, its overrides naming ``--model.attn_backend sdpa``.
    FSDP CPU offload (the last switch) moves every parameter over PCIe each step, which
    costs far more than a larger degree inside a node or the backend change: it is tried
    only when nothing fits without it.
    """
    hq, hkv = args.n_heads // layout.tp, args.n_kv_heads // layout.tp

    def flags_for(sp: int, cp: int) -> list[str]:
        flags = [f"--parallelism.ulysses_degree {sp}"]
        if cp > 1 or layout.cp > 1:
            flags.append(f"--parallelism.context_parallel_degree {cp}")
        return flags

    ranks = world // layout.tp
    keep, to_sdpa = [], []  # (sp, cp, layout overrides): splits that keep the backend, and those that need sdpa
    for n in (n for n in range(1, ranks + 1) if ranks % n == 0):
        sp = max(s for s in range(1, min(n, hq) + 1) if n % s == 0 and is_even(hq, hkv, s))
        cp = n // sp
        hybrid = [] if seq_len % (sp if cp == 1 else 2 * cp * sp) else [(sp, cp, flags_for(sp, cp))]
        uneven = [(n, 1, flags_for(n, 1))] if cp > 1 and n <= hq and seq_len % n == 0 else []
        if cp == 1 or get_backend(attn_backend).cp:  # the attention registry: does it run under cp
            keep += hybrid + uneven
        else:
            keep += uneven
            to_sdpa += [(s, c, [*f, "--model.attn_backend sdpa"]) for s, c, f in hybrid]
    for order in (SWITCH_ORDER[:-1], SWITCH_ORDER):
        for sp, cp, flags in keep + to_sdpa:
            trial = Layout(dp_shard=world // (sp * cp * layout.tp), sp=sp, tp=layout.tp, cp=cp, ep=layout.ep)
            sw, overrides = switches, {}
            for i in range(len(order) + 1):
                if i:
                    flag, change = order[i - 1]
                    sw = dataclasses.replace(sw, **change)
                    overrides[flag.split()[0]] = flag  # a later AC mode replaces an earlier one
                est = estimate(args, trial, sw, seq_len, batch)
                if est.total <= budget:
                    return sp, [*flags, *overrides.values()], est
    return None


def devices_that_fit(total: float) -> str:
    """Which of ``DEVICES`` a step of ``total`` bytes fits (within ``BUDGET`` of the device), in words."""
    fits = [f"{name} ({gib:g} GB)" for name, gib in DEVICES if total <= BUDGET * gib * GIB]
    need = f"needs {total / BUDGET / GIB:.0f} GiB of device memory (the step within {BUDGET:.0%} of it)"
    if len(fits) == len(DEVICES):
        return f"{need}: fits an {' or an '.join(fits)}"
    if fits:
        return f"{need}: more than an {DEVICES[0][0]} ({DEVICES[0][1]:g} GB); fits an {' or an '.join(fits)}"
    return f"{need}: more than any of {', '.join(f'{n} ({g:g} GB)' for n, g in DEVICES)}"


def _stronger(switches: Switches, change: dict) -> bool:
    """Whether ``change`` (a SWITCH_ORDER step) saves memory over ``switches`` as they are."""
    key, value = next(iter(change.items()))
    if key == "ac_mode":
        return _AC_STRENGTH[value] > _AC_STRENGTH[switches.ac_mode]
    if key == "loss_backend":  # fused and chunked hold one chunk of logits; materialized all of them
        return switches.loss_backend == "materialized"
    if key == "mlp_tile_size":
        return getattr(switches, key) == 0
    return getattr(switches, key) != value


def at_this_layout(args, layout: Layout, switches: Switches, seq_len, batch, budget):
    """The fewest memory switches (SWITCH_ORDER's, cumulative, those that save memory over ``switches``)
    that fit ``budget`` bytes at this very layout: (overrides, estimate) or None."""
    sw, overrides = switches, {}
    for flag, change in SWITCH_ORDER:
        if not _stronger(sw, change):
            continue
        sw = dataclasses.replace(sw, **change)
        overrides[flag.split()[0]] = flag
        est = estimate(args, layout, sw, seq_len, batch)
        if est.total <= budget:
            return list(overrides.values()), est
    return None


def memory_warning(config, dims, world_size: int, device_bytes: float, args=None) -> str | None:
    """A warning when the estimate exceeds the device, naming what estimate_memory.py recommends
    (``args``: the run spec's model, default the config's)."""
    args, layout, switches = from_config(config, dims, args)
    t = config.training
    est = estimate(args, layout, switches, t.seq_len, t.local_batch_size)
    if est.total <= device_bytes:
        return None
    rec = recommend(args, layout, switches, t.seq_len, t.local_batch_size, world_size, BUDGET * device_bytes,
                    config.model.attn_backend)
    advice = ("no ulysses_degree within the job and no memory switch makes it fit: shorten training.seq_len"
              if rec is None else f"scripts/estimate_memory.py recommends {' '.join(rec[1])} ({rec[2].total / GIB:.1f} GiB)")
    here = at_this_layout(args, layout, switches, t.seq_len, t.local_batch_size, BUDGET * device_bytes)
    if here is not None:  # the AC mode or offload that fits without changing the layout
        advice = f"at this layout {' '.join(here[0])} fits ({here[1].total / GIB:.1f} GiB); " + advice
    return (f"the memory estimate of this config is {est.total / GIB:.1f} GiB per device, more than the device's "
            f"{device_bytes / GIB:.1f} GiB (seq_len {t.seq_len}, layout {dims.degrees}); {advice}; "
            f"details: python scripts/estimate_memory.py --config <this config> --world-size {world_size}")
