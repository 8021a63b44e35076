"""What a step is predicted to hold on a device: the estimate plus what compile and the allocator added, as measured.

``estimate.py`` models an eager step's allocated bytes (the 6M limits point: within 0.2% of its allocated peak).
A compiled step on CUDA holds more: the H100 and H200 reserved 59.2 GiB for the compiled 8B/128K AC-full step
that the estimate puts at 27.9 GiB, 48.1 with 4 head stages, 68.4 with full_offload. What compile keeps has
not been seen yet (the suite's offload case now brings a memory snapshot back: benchmarks/memory_snapshot.py),
so the planner takes it as measured: where a cell of the same model shape, local tokens and switches was
measured (``measured.py``; the same device first, else another Hopper's), its reserved peak minus its estimate
is added. The cells record reserved peaks, so this excess is compile's and the allocator's reserve together;
elsewhere the estimate stands alone and the line says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_ulysses.planning.estimate import estimate
from titan_ulysses.planning.inputs import GIB, Layout, Switches
from titan_ulysses.planning.measured import CELLS, Cell


@dataclass
class Predicted:
    estimate: float  # bytes, estimate.py's
    extra: float  # bytes a measured cell of this layout reserved beyond its estimate (0: no such cell)
    cell: Cell | None

    @property
    def total(self) -> float:
        return self.estimate + self.extra

    def note(self) -> str:
        if self.cell is None:
            return "no measured cell of this shape and switches: the estimate alone (it models eager steps)"
        c = self.cell
        return (f"+{self.extra / GIB:.1f} GiB that the measured cell {c.name} ({c.device}, {c.date}) reserved beyond "
                f"its estimate ({c.reserved_gib:g} GiB reserved peak; compile's and the allocator's, not told apart)")


@functools.lru_cache(maxsize=None)
def _shape(flavor: str) -> tuple:
    from titan_ulysses.models.flavors import get_flavor

    a = get_flavor(flavor)
    return a, (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_hidden_dim, a.vocab_size)


@functools.lru_cache(maxsize=None)
def _estimate_of(c: Cell) -> float:
    sw = Switches(ac_mode=c.ac_mode, loss_chunk_size=c.loss_chunk_size, mlp_tile_size=c.mlp_tile_size,
                  head_stages=c.head_stages, act_bytes=2)
    return estimate(_shape(c.flavor)[0], Layout(sp=c.sp), sw, c.seq_len).total


def measured_cell(args, layout: Layout, s: Switches, seq_len: int, local_batch: int, compiled: bool,
                  device: str) -> Cell | None:
    """The newest cell of this model shape, local tokens and switches with a peak, on ``device`` first."""
    tokens = local_batch * seq_len / (layout.sp * layout.cp)
    found = []
    for c in CELLS:
        if c.reserved_gib is None or (c.ac_mode, c.head_stages, c.mlp_tile_size, c.compiled, c.precision) != (
                s.ac_mode, s.head_stages, s.mlp_tile_size, compiled, "bf16") or c.seq_len / c.sp != tokens:
            continue
        if _shape(c.flavor)[1] == (
                args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim, args.vocab_size):
            found.append(c)
    found.sort(key=lambda c: (c.device == device, c.date))
    return found[-1] if found else None


def predicted(args, layout: Layout, s: Switches, seq_len: int, local_batch: int = 1, compiled: bool = True,
              device: str = "H100") -> Predicted:
    """The estimate of this step plus a measured cell's excess where one matches (``measured_cell``)."""
    est = estimate(args, layout, s, seq_len, local_batch).total
    cell = measured_cell(args, layout, s, seq_len, local_batch, compiled, device) if s.lora_rank == 0 else None
    extra = max(cell.reserved_gib * GIB - _estimate_of(cell), 0.0) if cell else 0.0
    return Predicted(estimate=est, extra=extra, cell=cell)
