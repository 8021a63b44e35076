"""What was alive at the peak of a CUDA memory snapshot (``[profiling] enable_memory_snapshot``'s pickle).

    python benchmarks/memory_snapshot.py SNAPSHOT.pickle [--top 20]

``torch.cuda.memory._dump_snapshot`` writes the allocator's segments (what is allocated when it is taken) and
the trace of allocations and frees before it. ``at_peak`` replays the trace backwards from the blocks alive at
the end -- each ``free_completed`` puts its block back, each ``alloc`` takes it out -- and keeps the set of
blocks alive at the moment the allocated total was largest (a trace cut by its ring buffer still gives the peak
within the trace). ``summary`` ranks those blocks by size with the Python frame that allocated each (the first
frame in our code, else in torch) and sums them by that frame: the suite's offload case writes it beside the
pickle, so that a GPU window brings back what compile holds, not only how much.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from collections import defaultdict

OURS = ("titan_ulysses/", "benchmarks/")


def _site(frames: list[dict] | None) -> str:
    """The allocating frame worth naming: the innermost in our code, else the innermost in torch, else '?'."""
    frames = frames or []
    for wanted in (OURS, ("torch/",)):
        for f in frames:
            name = str(f.get("filename", "")).replace(os.sep, "/")
            if any(w in name for w in wanted):
                return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line', '?')} {f.get('name', '')}"
    return "?" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('line', '?')}"


def live_at_end(snapshot: dict, device: int = 0) -> dict[int, dict]:
    """addr -> {size, frames} of the blocks allocated when the snapshot was taken (its segments)."""
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", 0) != device:
            continue
        addr = seg["address"]
        for block in seg.get("blocks", []):
            if block.get("state") == "active_allocated":
                live[addr] = {"size": block["size"], "frames": block.get("frames", [])}
            addr += block["size"]
    return live


def at_peak(snapshot: dict, device: int = 0) -> tuple[int, dict[int, dict], int]:
    """(peak allocated bytes within the trace, the blocks alive then: addr -> {size, frames}, the trace event it
    precedes)."""
    live = live_at_end(snapshot, device)
    total = sum(b["size"] for b in live.values())
    best, best_live, best_at = total, dict(live), len(snapshot.get("device_traces", [[]])[device] or [])
    trace = (snapshot.get("device_traces") or [[]])[device] or []
    for i in range(len(trace) - 1, -1, -1):  # before event i, undo it
        e = trace[i]
        if e["action"] == "alloc":
            if live.pop(e["addr"], None) is not None:
                total -= e["size"]
        elif e["action"] == "free_completed":
            # the block was alive before its free; the alloc that made it (earlier in the trace) has its frames
            live[e["addr"]] = {"size": e["size"], "frames": e.get("frames", [])}
            total += e["size"]
        else:
            continue
        if total > best:
            best, best_live, best_at = total, dict(live), i
    # the frames of a block freed after the peak are those of its alloc, if the trace holds it
    allocs = {e["addr"]: e.get("frames", []) for e in trace[:best_at] if e["action"] == "alloc"}
    for addr, block in best_live.items():
        if addr in allocs:
            block["frames"] = allocs[addr]
    return best, best_live, best_at


def summary(snapshot: dict, top: int = 20, device: int = 0) -> dict:
    """The peak, its largest live blocks and the bytes by allocating site, as a JSON-able dict."""
    peak, live, index = at_peak(snapshot, device)
    blocks = sorted(live.values(), key=lambda b: -b["size"])
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for b in blocks:
        s = sites[_site(b["frames"])]
        s[0] += b["size"]
        s[1] += 1
    reserved = sum(seg["total_size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == device)
    return {"peak_allocated_gib": peak / 2**30, "reserved_at_dump_gib": reserved / 2**30, "trace_index": index,
            "live_blocks": len(blocks),
            "top_blocks": [{"gib": b["size"] / 2**30, "site": _site(b["frames"])} for b in blocks[:top]],
            "by_site": [{"gib": v[0] / 2**30, "blocks": v[1], "site": k}
                        for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]]}


def summarise_file(path: str, top: int = 20) -> dict:
    with open(path, "rb") as f:
        return summary(pickle.load(f), top)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("snapshot")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    print(json.dumps(summarise_file(a.snapshot, a.top), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
