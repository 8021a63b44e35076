"""Helpers that more than one test file uses, in one place (test files import nothing from each other).

Trainer runs: ``BASE`` arguments, ``layout``, ``run`` (gloo ranks through ``dist_utils``), their
metrics; ``run_fake_world`` (train.py in one process on a fake world). Checkpoints: a
manager over the tiny model (``checkpoint_setup``) and exact comparisons. Ulysses attention
against one process (``attention_matches``).
"""

import json
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

from dist_utils import assert_close, run_distributed
from model_harness import build_pair, full, small_args
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.config.manager import load_config
from titan_ulysses.data.sharding import shard_for_sp
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.ulysses import UlyssesAttention
from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
from titan_ulysses.ops.attention import build_attention, build_attention_mask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- trainer runs ------------------------------------------------------------------------------

# A schedule that does not depend on the total step count, so a run cut at step 3 and
# resumed to step 6 follows the same learning rates as an uninterrupted 6-step run.
BASE = [
    "--model.flavor", "debugmodel", "--training.dataset", "passkey",
    "--training.seq_len", "128", "--training.global_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--training.max_norm", "1.0",
    "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
    "--metrics.log_freq", "1",
]


def layout(sp=1, dp_shard=-1, local_batch=4):
    return ["--parallelism.ulysses_degree", str(sp), "--parallelism.data_parallel_shard_degree", str(dp_shard),
            "--training.local_batch_size", str(local_batch)]


def read_metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(metrics):
    return {m["step"]: m["loss"] for m in metrics}


def train_worker(argv, hooks=None):
    from titan_ulysses.trainer import Trainer

    trainer = Trainer(load_config(argv))
    if hooks == "sigterm_rank0_at_2" and dist.get_rank() == 0:
        step_fn = trainer.train_step

        def signal_then_step(data_iter):
            if trainer.step == 1:  # step 2 is starting: its guard sees the signal
                os.kill(os.getpid(), signal.SIGTERM)
            return step_fn(data_iter)

        trainer.train_step = signal_then_step
    if hooks == "nan_at_3":
        step_fn = trainer.train_step

        def poisoned_step(data_iter):
            if trainer.step == 2:  # step 3 sees NaN weights on every rank
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.fill_(float("nan"))
            return step_fn(data_iter)

        trainer.train_step = poisoned_step
    trainer.train()


def run(world, argv, tmp, name, hooks=None):
    folder = str(tmp / name)
    run_distributed(train_worker, world, BASE + argv + ["--job.dump_folder", folder], hooks)
    return read_metrics(folder)


def run_fake_world(tmp_path, world: int, *overrides: str):
    """train.py on the debug model as rank 0 of a fake world of ``world``, one process: (stdout, metrics lines)."""
    out = tmp_path / "fake"
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "train_configs/debug_model.toml", "--comm.mode", "fake",
         "--comm.fake_world_size", str(world), "--training.local_batch_size", "1", *overrides,
         "--checkpoint.enable", "false", "--job.dump_folder", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, [json.loads(line) for line in open(out / "metrics.jsonl")]


# -- checkpoints -------------------------------------------------------------------------------

class Counter:
    """A stand-in for the data loader / scheduler: any object with state_dict/load_state_dict."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def checkpoint_setup(folder, layout=None, **kwargs):
    pd = ParallelDims(**(layout or {"sp": 2}), world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    _, model = build_pair(small_args(), pd, ParallelizeOptions(param_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader, sched = Counter(), Counter()
    mgr = CheckpointManager(folder=folder, model=model, optimizer=opt, lr_scheduler=sched, dataloader=loader,
                            enable=True, interval=1, **kwargs)
    return model, opt, loader, sched, mgr


def add_manifest(step_dir) -> None:
    """Commit a checkpoint written without the manager (``dcp.save`` in one process, a model record)
    as the manager does: its manifest, which every reader verifies before reading (issue 33)."""
    from titan_ulysses.checkpoint import manifest

    step_dir = str(step_dir)
    manifest.write_manifest(step_dir, 0, {name: manifest.checksum(os.path.join(step_dir, name))
                                          for name in manifest.data_files(step_dir)})


def tiny_train_step(model, opt):
    tokens = torch.randint(0, 264, (1, 8), generator=torch.Generator().manual_seed(7))
    model(tokens, labels=tokens).backward()
    opt.step()
    opt.zero_grad()


def snapshot(model):
    return {n: full(p.detach()).clone() for n, p in model.named_parameters()}


def assert_equal(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys(), f"{what}: {sorted(actual)} != {sorted(expected)}"
    for name, value in expected.items():
        if isinstance(value, dict):
            assert_equal(actual[name], value, f"{what} {name}")
        else:
            assert torch.equal(actual[name], value), f"{what} {name} differs"


def scramble(model):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)


# -- Ulysses attention -------------------------------------------------------------------------

def build_sp_mesh(sp):
    pd = ParallelDims(sp=sp, world_size=dist.get_world_size())
    pd.build_mesh("cpu")
    return pd.get_mesh("sp")


def attention_matches(sp, n_heads, n_kv_heads, seq_len, backend, with_docs, backward=True):
    sp_mesh = build_sp_mesh(sp)
    rank = sp_mesh.get_local_rank()
    torch.manual_seed(0)
    b, d = 2, 8
    q = torch.randn(b, seq_len, n_heads, d, requires_grad=backward)
    k = torch.randn(b, seq_len, n_kv_heads, d, requires_grad=backward)
    v = torch.randn(b, seq_len, n_kv_heads, d, requires_grad=backward)
    grad_out = torch.randn(b, seq_len, n_heads, d)
    doc = torch.tensor([0] * (seq_len // 3) + [1] * (seq_len - seq_len // 3)).expand(b, seq_len) if with_docs else None

    ref_mask = build_attention_mask(backend, doc)
    ref = build_attention(backend)(q, k, v, ref_mask)
    if backward:
        ref.backward(grad_out)

    # the sharded run: pad S to a multiple of sp, keep this rank's slice
    s_pad = -(-seq_len // sp) * sp
    pad_doc = None if doc is None else torch.nn.functional.pad(doc, (0, s_pad - seq_len), value=-1)
    lq, lk, lv = (shard_for_sp(t.detach(), rank, sp, 0.0).requires_grad_(backward) for t in (q, k, v))
    attn = UlyssesAttention(build_attention(backend), sp_mesh)
    out = attn(lq, lk, lv, build_attention_mask(backend, pad_doc))

    n_real = max(0, min(seq_len - rank * (s_pad // sp), s_pad // sp))  # real tokens in this slice
    sl = slice(rank * (s_pad // sp), rank * (s_pad // sp) + n_real)
    assert_close(out[:, :n_real], ref[:, sl], "output")
    if not backward:
        return
    local_grad_out = shard_for_sp(grad_out, rank, sp, 0.0)
    local_grad_out[:, n_real:] = 0  # padding outputs feed no loss
    out.backward(local_grad_out)
    for name, local, whole in (("dq", lq, q), ("dk", lk, k), ("dv", lv, v)):
        assert_close(local.grad[:, :n_real], whole.grad[:, sl], name)


def trace_events(path: str) -> list[dict]:
    """The events of a Chrome trace file the profiler wrote (``[profiling]``)."""
    with open(path) as f:
        return json.load(f)["traceEvents"]
