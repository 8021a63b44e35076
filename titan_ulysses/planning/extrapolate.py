"""Which steps ``track.track_step`` traces, and how it extrapolates them in layers and tokens.

A traced step costs a Python call per op, and the ops grow with the layers and with the tokens over the
chunk sizes; neither changes what a phase holds except by adding equal terms. So a deep, long step is
traced at three and four layers (or groups of checkpointed layers) and at two short lengths, each event
(an op, where in our code, under which autograd node and modules) extrapolated on its own and checked at
a third length: a byte off the line, or a size threshold crossed before the target, and the full length is
traced instead. Why that is exact, and what the check cannot see: docs/memory_model.md, "How the tracker
checks it". ``tests/test_memory_track.py`` compares both with direct traces, to the byte.
"""

from __future__ import annotations

import math

from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.phases import Phase, StepMemory

SAMPLES = (3, 4)
"""Multiples of the token quantum traced; the line through them is checked at ``CHECK``. Not 1 and 2: a
loop's first two chunks differ from the rest (the tiled MLP's backward holds the previous tile's weight
gradients beside their sum only from its third tile on), and an MLP of one tile is not tiled."""
CHECK = 5
MIN_QUANTA = 32
"""Lengths of fewer token quanta per rank are traced as they are: the three short traces (12 quanta
and three model builds) cost more (Llama-3-8B at 16 quanta: 28.5 s of CPU against 19 s traced whole)."""


def tracked_layer_counts(n_layers: int, extrapolate: bool = True, group: int = 1) -> tuple[int, ...]:
    """The model depths :func:`track_step` traces (one step each): all layers, or three and four groups
    of ``group`` layers (the last one as short as at ``n_layers``)."""
    units = -(-n_layers // group)
    short = units * group - n_layers
    return (n_layers,) if not extrapolate or units <= 4 else (3 * group - short, 4 * group - short)


def token_quantum(layout: Layout, switches: Switches) -> int:
    """The local tokens per rank of which every token loop runs whole chunks: the lcm of the norm's chunk,
    the MLP tile, the loss chunk and, under cp, twice sdpa's query block."""
    from titan_ulysses.ops import norm
    from titan_ulysses.ops.attention.sdpa import BLOCK

    sizes = [norm.CHUNK_TOKENS, switches.mlp_tile_size, switches.loss_chunk_size, 2 * BLOCK if layout.cp > 1 else 0]
    return math.lcm(*(s for s in sizes if s > 0))


def local_tokens(seq_len: int, layout: Layout) -> int:
    from titan_ulysses.data.sharding import padded_length

    return padded_length(seq_len, layout.sp, layout.cp) // (layout.sp * layout.cp)


def sample_lengths(seq_len: int, layout: Layout, switches: Switches) -> tuple[tuple[int, ...], str]:
    """The sequence lengths to trace (two samples and the check) and ``""``, or ``(seq_len,)`` and why."""
    q, local = token_quantum(layout, switches), local_tokens(seq_len, layout)
    if local % q:
        return (seq_len,), f"{local:,} tokens per rank are not a multiple of the chunks' {q:,}"
    if local < MIN_QUANTA * q:
        return (seq_len,), ""  # short enough to trace
    per_rank = layout.sp * layout.cp
    return tuple(k * q * per_rank for k in (*SAMPLES, CHECK)), ""


def _line(a: int, b: int, m: int) -> int:
    """The value at ``m`` quanta on the line through ``a`` at ``SAMPLES[0]`` and ``b`` at ``SAMPLES[1]``."""
    return a + (b - a) * (m - SAMPLES[0]) // (SAMPLES[1] - SAMPLES[0])


def _kinds(a: dict, b: dict, m: int) -> dict:
    return {k: _line(a.get(k, 0), b.get(k, 0), m) for k in {**a, **b}}


def off_the_line(a, b, c=None) -> str:
    """Where the keyed steps ``a``, ``b`` (the samples) and ``c`` (the check) are not affine; ``""``
    where they are, to the byte. Without ``c``: only whether ``a`` and ``b`` have the same events."""
    for step in (a, b, c or a):
        if step.thresholds:
            return f"a size threshold lies between the samples and the target ({step.thresholds[0]})"
    if c is None:
        same = a.events.keys() == b.events.keys() and all(a.events[p].keys() == b.events[p].keys() for p in a.events)
        return "" if same else "the ops differ between the samples"
    if a.events.keys() != b.events.keys() or b.events.keys() != c.events.keys():
        return "the phases differ between the samples"
    for phase, ev_c in c.events.items():
        ev_a, ev_b = a.events[phase], b.events[phase]
        if not ev_a.keys() == ev_b.keys() == ev_c.keys():
            return f"{phase}: the ops differ between the samples"
        for key, (dev, kinds, host) in ev_c.items():
            (da, ka, ha), (db, kb, hb) = ev_a[key], ev_b[key]
            if _line(da, db, CHECK) != dev or _line(ha, hb, CHECK) != host or _kinds(ka, kb, CHECK) != \
                    {k: kinds.get(k, 0) for k in {**ka, **kb, **kinds}}:
                return f"{phase}: {key[0]} at {key[1]} is {dev:,} bytes, not {_line(da, db, CHECK):,} on the line"
    return ""


def at_length(a, b, m: int):
    """The step of the keyed samples ``a``, ``b`` (one depth) at ``m`` token quanta: each event on its line,
    each phase the largest of its events there."""
    phases, host = {}, 0
    for name, ev_b in b.events.items():
        best = None
        for key, (db, kb, hb) in ev_b.items():
            da, ka, ha = a.events[name][key]
            dev = _line(da, db, m)
            host = max(host, _line(ha, hb, m))
            if best is None or dev > best[0]:
                best = (dev, ka, kb)
        phases[name] = Phase(name, best[0], _kinds(best[1], best[2], m))
    return StepMemory(peak=max(p.peak for p in phases.values()), phases=phases, host_peak=host)


def to_depth(small, large, n_layers: int, group: int = 1):
    """Steps at three (``small``) and four (``large``) groups of ``group`` layers -> the step at ``n_layers``.

    The blocks are identical, so a phase is affine in the number of groups for a fixed position from the
    bottom or the top: a block's backward is keyed by its group's place (the two lowest and the two highest)
    and its place in the group. A short last group (``n_layers`` not a multiple of ``group``) is the top
    group of both traces too."""
    units = -(-n_layers // group)
    grow = units - 4

    def by_position(step, n: int) -> dict:  # "layer i backward" -> "bottom g j" and "top g j" (g < 2)
        out, top = {}, -(-n // group) - 1
        for name, phase in step.phases.items():
            if name.startswith("layer "):
                g, j = divmod(int(name.split()[1]), group)
                for key in (f"bottom {g} {j}", f"top {top - g} {j}"):
                    if int(key.split()[1]) < 2:
                        out[key] = phase
            else:
                out[name] = phase
        return out

    a, b = by_position(small, n_layers - grow * group - group), by_position(large, n_layers - grow * group)
    phases = {}
    for key, p4 in b.items():
        p3 = a[key]
        kinds = {k: v + grow * (v - p3.kinds.get(k, 0)) for k, v in p4.kinds.items()}
        peak = p4.peak + grow * (p4.peak - p3.peak)
        if key.startswith(("bottom", "top")):
            _, g, j = key.split()
            g = int(g) if key.startswith("bottom") else units - 1 - int(g)
            key = f"layer {g * group + int(j)} backward"
        phases[key] = Phase(key, peak, kinds)
    order = [n for n in b if not n.startswith(("bottom", "top"))]
    layers = sorted((n for n in phases if n.startswith("layer ")), key=lambda n: -int(n.split()[1]))
    at = order.index("embedding backward") if "embedding backward" in order else len(order)
    names = order[:at] + layers + order[at:]
    host = large.host_peak + grow * (large.host_peak - small.host_peak)
    return StepMemory(peak=max(p.peak for p in phases.values()), phases={n: phases[n] for n in names}, host_peak=host)
