"""``benchmarks/memory_snapshot.py`` (issue 44 item 1): the blocks alive at a CUDA memory snapshot's peak, from a
synthetic snapshot in the allocator's own format (segments with their blocks, the trace of allocs and frees)."""

from __future__ import annotations

import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory_snapshot import at_peak, main, summary  # noqa: E402

MIB = 2**20


def frames(path: str, line: int, name: str) -> list[dict]:
    return [{"filename": f"/usr/lib/python3/site-packages/{path}", "line": line, "name": name},
            {"filename": "/repo/train.py", "line": 1, "name": "<module>"}]


LOSS = frames("titan_ulysses/ops/loss.py", 120, "backward")
COMPILED = frames("torch/_inductor/output_code.py", 40, "call")
OFFLOAD = frames("titan_ulysses/distributed/activation_offload.py", 88, "pack")


def snapshot() -> dict:
    """Before the trace: a 64 MiB block (parameters) alive throughout. In the trace: the loss's 256 MiB and a
    compiled graph's 512 MiB alive together (the peak), then both freed and an offload buffer of 128 MiB kept."""
    base, loss, graph, buffer = 0x1000_0000, 0x2000_0000, 0x3000_0000, 0x4000_0000
    trace = [
        {"action": "alloc", "addr": loss, "size": 256 * MIB, "frames": LOSS},
        {"action": "alloc", "addr": graph, "size": 512 * MIB, "frames": COMPILED},
        {"action": "free_requested", "addr": loss, "size": 256 * MIB, "frames": []},
        {"action": "free_completed", "addr": loss, "size": 256 * MIB, "frames": []},
        {"action": "alloc", "addr": buffer, "size": 128 * MIB, "frames": OFFLOAD},
        {"action": "free_completed", "addr": graph, "size": 512 * MIB, "frames": []},
    ]
    segments = [
        {"device": 0, "address": base, "total_size": 96 * MIB, "allocated_size": 64 * MIB,
         "blocks": [{"size": 64 * MIB, "state": "active_allocated", "frames": frames("titan_ulysses/optim.py", 9, "x")},
                    {"size": 32 * MIB, "state": "inactive"}]},
        {"device": 0, "address": buffer, "total_size": 128 * MIB, "allocated_size": 128 * MIB,
         "blocks": [{"size": 128 * MIB, "state": "active_allocated", "frames": OFFLOAD}]},
        {"device": 0, "address": loss, "total_size": 768 * MIB, "allocated_size": 0,
         "blocks": [{"size": 768 * MIB, "state": "inactive"}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_the_blocks_alive_at_the_peak_are_ranked_with_the_frame_that_allocated_them(tmp_path, capsys):
    snap = snapshot()
    peak, live, index = at_peak(snap)
    sizes = {b["size"] for b in live.values()}
    assert peak == (64 + 256 + 512) * MIB and sizes == {64 * MIB, 256 * MIB, 512 * MIB}
    assert index == 3  # the state before trace event 3, the loss's free_completed
    s = summary(snap, top=2)
    assert [b["gib"] * 2**30 for b in s["top_blocks"]] == [512 * MIB, 256 * MIB]
    assert s["top_blocks"][0]["site"] == "_inductor/output_code.py:40 call"  # a compiled graph's buffer
    assert s["top_blocks"][1]["site"] == "ops/loss.py:120 backward"  # ours before torch's frames
    assert s["reserved_at_dump_gib"] * 2**30 == (96 + 128 + 768) * MIB and s["live_blocks"] == 3
    path = tmp_path / "rank0_memory_snapshot.pickle"
    path.write_bytes(pickle.dumps(snap))
    assert main([str(path), "--top", "1"]) == 0
    assert '"site": "_inductor/output_code.py:40 call"' in capsys.readouterr().out


def test_a_peak_after_the_trace_is_the_end_state():
    """A trace whose last events allocate: the peak is at the dump, made of the segments' live blocks."""
    snap = snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][4:5]  # only the offload buffer's alloc is in the trace
    peak, live, _ = at_peak(snap)
    assert peak == (64 + 128) * MIB and len(live) == 2
