"""The step-time model (``titan_ulysses/planning/timing.py``) against every measured GPU cell.

    python scripts/check_timing.py            # one row per cell of planning/measured.py: predicted, measured, error
    python scripts/check_timing.py --fit      # how planning/rates.py's fitted figures follow from the cells
    python scripts/check_timing.py --markdown # the table for docs/bench_devices.md

Each cell is predicted with its own device's rates (``planning/rates.py``); a cell whose error exceeds 15% is
printed with the reason the model gives for it. Which cells a rate was fitted to is said in rates.py: those
cells are in-sample, the rest test the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_ulysses.models.flavors import get_flavor  # noqa: E402
from titan_ulysses.planning.inputs import Layout, Switches  # noqa: E402
from titan_ulysses.planning.measured import CELLS, Cell  # noqa: E402
from titan_ulysses.planning.rates import RATES, DeviceRates  # noqa: E402
from titan_ulysses.planning.timing import step_time  # noqa: E402

TOLERANCE_PCT = 15.0
FITTED = {  # cell (name, device, date) -> the rate fitted to it (rates.py)
    ("8b_128k_sim8_compile_bf16_selective", "H200", "2026-11-26"): "hbm_efficiency",
    ("8b_128k_sim8_compile_bf16_full", "H200", "2026-11-26"): "attention_fwd_fraction[cudnn]",
    ("8b_128k_sim8_eager_bf16_full", "H200", "2026-11-26"): "eager_memory_factor",
    ("8b_128k_sim8_compile_float8_selective", "H200", "2026-11-26"): "float8_linear_speedup",
    ("8b_128k_sim8_eager_bf16_full_offload", "H200", "2026-11-26"): "host_exposed_gbs",
    ("8b_128k_sim8_compile_bf16_full_offload", "H100", "2026-11-28"): "host_exposed_gbs",
}
REASONS = {  # why a cell is off, where the model knows it
    "1B": "the 1B's head_dim 64 attention and its small matmuls (dim 2048) have no measured rate: the model takes "
          "the 8B's (head_dim 128 at 128K); the suite's bench_rates case measures them",
    "before the fix": "measured before issue 39's offload fix (hooks left open under compile)",
    "flash": "recorded as FlashAttention first (PyTorch's order), yet within 0.5% of the cuDNN cell of 2026-11-26, "
             "and FlashAttention's measured rate (40% of matmul) cannot give this figure: the kernel that ran was "
             "likely not FlashAttention (the run did not record it)",
}


def inputs(c: Cell):
    args = get_flavor(c.flavor)
    sw = Switches(ac_mode=c.ac_mode, loss_chunk_size=c.loss_chunk_size, mlp_tile_size=c.mlp_tile_size,
                  head_stages=c.head_stages, act_bytes=2)
    return args, Layout(sp=c.sp), sw


def predict(c: Cell, rates: DeviceRates | None = None):
    args, layout, sw = inputs(c)
    return step_time(args, layout, sw, c.seq_len, rates or RATES[c.device], compiled=c.compiled,
                     precision=c.precision, attention=c.attention, simulated=c.simulated)


def rows() -> list[dict]:
    out = []
    for c in CELLS:
        p = predict(c)
        err = 100 * (p.tok_s - c.tok_s) / c.tok_s
        reason = ""
        if abs(err) > TOLERANCE_PCT:
            reason = REASONS["1B"] if c.flavor == "1B" else REASONS["before the fix"] if "before" in c.source else \
                REASONS["flash"] if c.attention == "flash" else "not explained by the model"
        out.append({"cell": c.name, "device": c.device, "date": c.date, "predicted_tok_s": p.tok_s,
                    "measured_tok_s": c.tok_s, "error_pct": err, "predicted_mfu_pct": p.mfu_pct,
                    "measured_mfu_pct": c.mfu_pct, "fitted": FITTED.get((c.name, c.device, c.date), ""),
                    "reason": reason, "source": c.source})
    return out


def fit(rounds: int = 30) -> list[str]:
    """Each fitted rate solved from its cell with the others held, repeated until they settle (one unknown per
    cell; a cell whose part cannot be positive leaves its rate as rates.py has it, and says so)."""
    rates = {k: dataclasses.replace(v, attention_fwd_fraction=dict(v.attention_fwd_fraction)) for k, v in RATES.items()}
    parts = {"hbm_efficiency": "memory-bound ops", "attention_fwd_fraction": "attention recompute",
             "eager_memory_factor": "memory-bound ops", "float8_linear_speedup": "block matmuls",
             "host_exposed_gbs": "offload (exposed)"}
    notes: dict[tuple, str] = {}
    for _ in range(rounds):
        for (name, device, date), rate in FITTED.items():
            c = next(x for x in CELLS if (x.name, x.device, x.date) == (name, device, date))
            p = predict(c, rates[device])
            key, _, kernel = rate.partition("[")
            kernel = kernel.rstrip("]")
            part = parts[key]
            rest = p.total - p.parts[part]
            need = p.tokens / c.tok_s - rest  # the seconds this part must take
            old = getattr(rates[device], key)[kernel] if kernel else getattr(rates[device], key)
            if need <= 0:
                notes[(device, rate)] = (f"{device} {rate}: not resolved by {name}, {date} (the other parts alone take "
                                         f"{rest:.3f} s of its {p.tokens / c.tok_s:.3f} s); rates.py's {old:.3g} kept")
                continue
            # every part is inversely proportional to its rate, except the eager factor (proportional)
            new = old * p.parts[part] / need if key != "eager_memory_factor" else old * need / p.parts[part]
            if kernel:
                rates[device].attention_fwd_fraction[kernel] = new
            else:
                rates[device] = dataclasses.replace(rates[device], **{key: new})
            if key in ("hbm_efficiency", "eager_memory_factor", "float8_linear_speedup") and device == "H200":
                h100 = rates["H100"]  # the H100 takes the H200's (rates.py says why)
                value = new * 4800 / 3350 if key == "hbm_efficiency" else new
                rates["H100"] = dataclasses.replace(h100, **{key: value})
            if kernel == "cudnn" and device == "H200":
                rates["H100"].attention_fwd_fraction["cudnn"] = new
            notes[(device, rate)] = f"{device} {rate}: {new:.3g} (rates.py: {_rate(RATES[device], key, kernel):.3g}) from {name}, {date}"
    return list(notes.values())


def _rate(r: DeviceRates, key: str, kernel: str) -> float:
    return getattr(r, key)[kernel] if kernel else getattr(r, key)


def markdown(table: list[dict]) -> str:
    lines = ["| cell | device, date | predicted tok/s (MFU) | measured tok/s (MFU) | error | note |",
             "|---|---|---|---|---|---|"]
    for r in table:
        mfu = f" ({r['measured_mfu_pct']:.1f}%)" if r["measured_mfu_pct"] is not None else ""
        note = f"fitted: {r['fitted']}" if r["fitted"] else r["reason"] or "held out"
        lines.append(f"| {r['cell']} | {r['device']}, {r['date']} | {r['predicted_tok_s']:,.0f} "
                     f"({r['predicted_mfu_pct']:.1f}%) | {r['measured_tok_s']:,.0f}{mfu} | {r['error_pct']:+.1f}% | "
                     f"{note} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", action="store_true", help="print how each fitted rate follows from its cell")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = p.parse_args(argv)
    if a.fit:
        print("\n".join(fit()))
        return 0
    table = rows()
    if a.markdown:
        print(markdown(table), end="")
        return 0
    print(f"step-time model (titan_ulysses/planning/timing.py) against {len(table)} measured cells; "
          f"tolerance {TOLERANCE_PCT:g}%")
    for r in table:
        flag = "" if abs(r["error_pct"]) <= TOLERANCE_PCT else f"  OFF: {r['reason']}"
        print(f"  {r['cell']:<46} {r['device']} {r['date']}: predicted {r['predicted_tok_s']:8,.0f} tok/s "
              f"({r['predicted_mfu_pct']:4.1f}% MFU), measured {r['measured_tok_s']:8,.0f}: {r['error_pct']:+6.1f}%"
              f"{'  [fitted: ' + r['fitted'] + ']' if r['fitted'] else ''}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
