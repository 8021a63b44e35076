"""A step that logs nothing reads nothing from the device (``training.sync_free_step``): the non-finite
skip is decided on the device (``step.StepGuard``'s ``found_inf``, taken by the fused AdamW), and the
guard -- loss, gradient norm, the skip and the preemption flag -- is read one step late, when the
device has finished it. With ``sync_free_step`` false the guard is read before every update (the old step).

On CPU nothing waits, so reads stand in for host syncs: a value read out of a tensor (``item``,
``tolist``, ``cpu``, ``bool`` / ``float`` / ``int``, ``numpy``) by our own code. On CUDA each such read
blocks the host until the device has caught up, and the next step's kernels cannot queue. A read of
an earlier step's guard (``StepGuard.read`` of a smaller step number) is "late": on CUDA it waits on
a copy the device finished a step ago. Packed rows (passkey rows hold one document) read nothing either: their
documents' spans are read from the loader's host batch (``SPBatch.spans``), so no mask and no layer reads the
device (the last two tests); a step's counts come up with its microbatches.
"""

import os
import sys

import torch

import titan_ulysses
from dist_utils import run_distributed
from helpers import BASE, layout, trace_events
from titan_ulysses.config.manager import load_config

PACKAGE = os.path.dirname(os.path.abspath(titan_ulysses.__file__))
READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy")


def count_reads(reads: list, current: list):
    """Patch torch.Tensor's reads to append (current step, where) for each call from the package;
    ``where`` starts with "late " for a read of an earlier step's guard."""
    from titan_ulysses.step import StepGuard

    def counting(name, read):
        def counted(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(PACKAGE):
                guard = frame.f_locals.get("self")
                late = isinstance(guard, StepGuard) and frame.f_code.co_name == "read" and guard.number < current[0]
                where = f"{'late ' if late else ''}{os.path.relpath(frame.f_code.co_filename, PACKAGE)}:{frame.f_lineno} {name}"
                reads.append((current[0], where))
            return read(self, *args, **kwargs)
        return counted

    for name in READS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))


def _reads_per_step(argv, folder):
    from titan_ulysses.trainer import Trainer

    reads, current = [], [0]
    count_reads(reads, current)
    for sync_free in ("true", "false"):
        # the second run also writes a profiler trace of its last step (profile_freq 4: warmup 3, active 1)
        profiling = ["--profiling.enable_profiling", "true", "--profiling.profile_freq", "4"] if sync_free == "false" else []
        trainer = Trainer(load_config(argv + profiling + ["--training.sync_free_step", sync_free,
                                                          "--job.dump_folder", f"{folder}-{sync_free}"]))
        step_fn = trainer.train_step

        def tracked(*args, step_fn=step_fn, trainer=trainer, **kwargs):  # what follows a step counts as that step's
            current[0] = trainer.step + 1
            return step_fn(*args, **kwargs)

        trainer.train_step = tracked
        reads.clear()
        trainer.train()
        current[0] = 0
        by_step = {step: [where for s, where in reads if s == step] for step in (1, 2, 3, 4)}
        assert by_step[1] and by_step[4], f"the logging steps read nothing: is the counter on? {reads}"
        if sync_free == "true":
            assert not by_step[2], f"step 2 logs nothing, yet reads the device: {by_step[2]}"
            assert len(by_step[3]) == 1 and by_step[3][0].startswith("late step.py"), \
                f"step 3 should read only step 2's guard, late: {by_step[3]}"
        else:  # the old step: the guard is read before each update
            for step in (2, 3):
                assert len(by_step[step]) == 1 and by_step[step][0].startswith("step.py"), (step, by_step[step])
            traces = os.path.join(f"{folder}-{sync_free}", "profiling", "traces")
            assert os.listdir(traces) == ["iteration_4"], os.listdir(traces)
            events = trace_events(os.path.join(traces, "iteration_4", f"rank{trainer.rank}_trace.json"))
            assert any(e.get("name", "").startswith("aten::") for e in events), "the trace holds no operator"


def test_a_step_that_logs_nothing_reads_nothing(tmp_path):
    # log_freq 10 over 4 steps: steps 1 and 4 (the first and the last) log, steps 2 and 3 do not
    argv = BASE + layout(sp=2) + ["--training.steps", "4", "--metrics.log_freq", "10", "--checkpoint.enable", "false"]
    run_distributed(_reads_per_step, 2, argv, str(tmp_path / "run"))


def test_the_step_counts_come_up_with_the_microbatches():
    """Issue 47 item 6: a logging step's counts were copied to the device by the trainer (``counts.to(device)``:
    a blocking copy from pageable memory, before the optimizer was queued); they travel in the step's
    ``StepData``, uploaded with its microbatches (``non_blocking`` from pinned memory on CUDA), by the names the
    step line reads them with."""
    from titan_ulysses.data.microbatches import COUNTS, StepBatches, StepData
    from titan_ulysses.trainer import LoggedCounts

    assert LoggedCounts._fields[:len(COUNTS)] == COUNTS
    rows = {"input": torch.ones(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
            "document_ids": torch.tensor([[0] * 6 + [-1] * 2, [1] * 8]), "truncated": torch.tensor([1, 0])}
    batches = StepBatches(2, 0, 2, 0, 1, torch.device("meta"), packed=True, pad_id=0)
    step = batches.next(iter([rows, rows]))
    assert isinstance(step, StepData) and len(step.microbatches) == 2
    assert step.counts.device.type == "meta" and all(mb.tokens.device.type == "meta" for mb in step.microbatches)
    host = batches.host(iter([rows, rows]))
    assert dict(zip(COUNTS, host.counts.tolist())) == {"padding": 4.0, "tokens": 32.0, "truncated": 2.0}
    assert host.microbatches[0].spans == [[(0, 6), (6, 8)], [(0, 8)]]  # read on the host, for the masks


def _packed(s: int):
    """Host document ids ``[1, s]`` of three documents and padding, their spans, and random q, k, v."""
    from titan_ulysses.ops.attention.masks import row_spans

    ids = torch.tensor([[0] * (s // 4) + [1] * (s // 2) + [2] * (s // 4 - 40) + [-1] * 40])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for _ in range(3))
    return ids, row_spans(ids), q.requires_grad_(), k, v


def test_packed_rows_read_nothing_per_layer_on_sdpa_above_the_dense_size_nor_for_flash_attn():
    """Issue 47 item 6: sdpa's per-document calls (above ``DENSE_MASK_MAX_ELEMENTS``, and cp's) read the document
    ids on every layer (``row_spans``: ``nonzero().tolist()``), flash_attn's offsets read them with ``nonzero()``
    and ``int(max)`` for every mask. With the spans the loader's host batch gives (``SPBatch.spans``), building
    the masks and two layers' forward and backward read nothing; the outputs, gradients and offsets are those
    of the masks built from the ids alone."""
    from titan_ulysses.ops.attention import DENSE_MASK_MAX_ELEMENTS, build_attention, build_attention_mask

    s = 4160
    assert s * s > DENSE_MASK_MAX_ELEMENTS  # the per-document path
    ids, spans, q, k, v = _packed(s)
    attention = build_attention("sdpa")
    reference = build_attention_mask("sdpa", ids)
    want = attention(q, k, v, reference)
    (want_grad,) = torch.autograd.grad(want.square().sum(), q)
    want_cu, want_max = build_attention_mask("flash_attn", ids).cu_seqlens

    reads, current, own = [], [1], {name: torch.Tensor.__dict__.get(name) for name in READS}
    count_reads(reads, current)
    try:
        mask = build_attention_mask("sdpa", ids, spans)
        outs = [attention(q, k, v, mask) for _ in range(2)]  # two layers, one mask
        (grad,) = torch.autograd.grad(sum(o.square().sum() for o in outs) / 2, q)
        flash = build_attention_mask("flash_attn", ids, spans)
    finally:  # torch's own reads back (this test runs in pytest's process)
        for name, read in own.items():
            setattr(torch.Tensor, name, read) if read is not None else delattr(torch.Tensor, name)
    assert reads == [], reads
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want) and torch.equal(grad, want_grad)
    assert torch.equal(flash.cu_seqlens[0], want_cu) and flash.cu_seqlens[1] == want_max
