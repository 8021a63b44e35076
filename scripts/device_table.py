"""docs/bench_devices.md's table: for each shipped long-context config, the layout the planner picks on 80 GB
and on 141 GB, with predicted and measured tok/s, MFU and peak side by side.

    python scripts/device_table.py            # the markdown table (pasted into docs/bench_devices.md)

Per config and device: the fastest switches that fit at the config's own layout (``planning/fastest.py``,
the config's world size from its header's ``torchrun`` line), the step-time model's tok/s and MFU on that
device's rates (``planning/rates.py``), the predicted peak (``planning/device_fit.py``). A cell is "measured"
where a recorded GPU cell (``planning/measured.py``) ran the same model shape, local tokens and switches on that
device (a simulated rank's compute, the model's traffic added for the real layout), else "predicted only".
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LONG_CONTEXT = ["llama3_8b_128k", "llama3_8b_128k_from_hf", "llama3_8b_512k", "llama3_1b_long", "llama3_8b_6m",
                "llama3_1b_2m_one_gpu", "llama3_8b_1m_one_h200", "qwen3_30b_a3b_1m"]
DEVICES = (("H100", 80.0), ("H200", 141.0))


def world_of(path: str) -> int:
    header = open(path).read().split("\n[", 1)[0]
    nproc = re.search(r"torchrun .*--nproc-per-node (\d+)", header)
    nnodes = re.search(r"--nnodes (\d+)", header)
    return int(nproc.group(1)) * (int(nnodes.group(1)) if nnodes else 1)


def row(name: str, device: str, gib: float) -> dict:
    from titan_ulysses.planning.fastest import fastest
    from titan_ulysses.planning.inputs import GIB, from_config
    from titan_ulysses.planning.rates import RATES, kernel_of
    from titan_ulysses.tools.estimate_memory import prepare

    path = os.path.join(ROOT, "train_configs", f"{name}.toml")
    argv = ["--config", path]
    hf = re.search(r"^hf_assets_path\s*=\s*\"([^\"]*)\"", open(path).read(), re.M)
    if hf and not os.path.isfile(os.path.join(ROOT, hf.group(1), "config.json")):  # Llama-3.1-8B's: not shipped
        argv += ["--model.hf_assets_path", "", "--model.flavor", "8B", "--model.tokenizer", "byte",
                 "--checkpoint.initial_load_in_hf", "false"]
    config, spec, dims = prepare(argv, world_of(path))
    args, layout, switches = from_config(config, dims, spec.args)
    t = config.training
    kernel = kernel_of(config.model.attn_backend)
    best = fastest(args, layout, switches, t.seq_len, t.local_batch_size, RATES[device], gib * GIB,
                   config.compile.enable, False, "float8" if config.float8.enable else "bf16", kernel)
    if best is None:
        return {"config": name, "device": device, "pick": "nothing fits at this layout"}
    measured = best.measured_tok_s is not None
    return {"config": name, "device": device, "pick": " ".join(best.overrides) or "as shipped",
            "layout": f"sp {layout.sp}, cp {layout.cp}, dp_shard {layout.dp_shard}", "kernel": kernel,
            "predicted_tok_s": best.time.tok_s, "predicted_mfu": best.time.mfu_pct,
            "peak_gib": best.memory.total / GIB, "measured_tok_s": best.measured_tok_s,
            "measured_mfu": best.memory.cell.mfu_pct if measured else None,
            "measured_peak": best.memory.cell.reserved_gib if measured else None,
            "cell": f"{best.memory.cell.name} ({best.memory.cell.device}, {best.memory.cell.date})" if measured else ""}


def markdown(rows: list[dict]) -> str:
    out = ["| config | device | the planner's pick (at the config's layout) | predicted tok/s, MFU, peak | "
           "measured tok/s, MFU, peak (reserved) | |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "predicted_tok_s" not in r:
            out.append(f"| `{r['config']}` | {r['device']} | {r['pick']} | | | predicted only |")
            continue
        pred = f"{r['predicted_tok_s']:,.0f}, {r['predicted_mfu']:.1f}%, {r['peak_gib']:.1f} GiB"
        meas = (f"{r['measured_tok_s']:,.0f}, {r['measured_mfu']:.1f}%, {r['measured_peak']:.1f} GiB: {r['cell']}"
                if r["measured_tok_s"] else "")
        mark = "measured (a simulated rank; traffic modelled)" if meas else "predicted only"
        out.append(f"| `{r['config']}` | {r['device']} | {r['pick']} ({r['layout']}, {r['kernel']}) | {pred} | "
                   f"{meas} | {mark} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    rows = [row(name, device, gib) for name in LONG_CONTEXT for device, gib in DEVICES]
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
