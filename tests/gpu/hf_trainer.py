"""TRL's SFTTrainer under ``ulysses_trainer`` at sp=2 in bf16, on gloo ranks sharing the device, against one
process (``gpu_suite.py --part correctness`` and ``rest``, case ``hf_sft_ulysses_bf16``).

The trainer is tests/test_hf_trainer.py's packed SFT (a tiny Llama, padding-free rows of
prompt/completion pairs with completion-only loss, gradient accumulation 2, SGD). The truth is
one fp32 process; the bf16 run at sp=2 must be as close to it as one bf16 process is (2x its
error + 2e-3, relative), in every step's loss and grad norm. ``bug_loss`` is the sp run with
the loss divided by the first micro-batch's token count instead of the whole step's (a
per-micro-batch normaliser, the bug the path must not have), to show the tolerance catches it. The sp runs are
under accelerate's FSDP2 (``fsdp=True``, bf16 through its mixed-precision policy); the one-process runs plain. The
Trainer takes the device from accelerate: both ranks are given LOCAL_RANK 0 so that they share GPU 0 (FSDP2 over
gloo on CUDA tensors).
"""

from __future__ import annotations

import os
import tempfile

import torch

from benchmarks.gpu_common import rel_err

from .multirank import spawn


def _train(device, world: int, runs: dict) -> dict:
    """Each named run ``(bf16, planted)`` of the SFT trainer: every step's loss and grad norm (the same on every
    rank). Several runs share one process start (TRL's imports take most of a run's time)."""
    import torch.distributed as dist
    from hf_fixtures import make_tokenizer
    from test_hf_trainer import FSDP2, build_trainer

    from titan_ulysses.integrations.transformers import trainer as ulysses

    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = {}
    with tempfile.TemporaryDirectory() as d:
        make_tokenizer(f"{d}/tok")
        for name, (bf16, planted) in runs.items():
            trainer = build_trainer("sft_packed", f"{d}/{name}", 2, f"{d}/tok", None, bf16=bf16,
                                    use_cpu=device.type == "cpu", **(FSDP2 if world > 1 else {}))
            if world > 1:
                trainer = ulysses.ulysses_trainer(trainer, sp=world)
            if planted:  # the first micro-batch's loss tokens instead of the whole step's
                def first_only(batch_samples, device):
                    return (ulysses.shifted_labels(batch_samples[0]) != -100).sum().to(device)
                trainer._get_num_items_in_batch = first_only
            assert trainer.accelerator.is_fsdp2 == (world > 1), trainer.accelerator.distributed_type
            trainer.train()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            out[name] = {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs]}
    return out


def _worst(a: dict, b: dict) -> dict:
    return {k: max(rel_err(torch.tensor(x), torch.tensor(y)) for x, y in zip(a[k], b[k])) for k in a}


def hf_sft_ulysses_bf16(ctx):
    timeout = ctx.timeout(240)
    one = spawn(1, "gloo", ctx.device.type, (_train, 1, {"truth": (False, False), "one": (True, False)}), timeout)
    sp = spawn(2, "gloo", ctx.device.type, (_train, 2, {"sp": (True, False), "bug": (True, True)}), timeout)
    failed = {k: r["error"] for k, r in (("one process", one), ("sp=2", sp)) if "error" in r}
    runs = {**one, **sp}
    if failed:
        return {"status": "fail", "figures": failed, "detail": str(failed)[:300]}
    one, sp, bug = (_worst(runs[k], runs["truth"]) for k in ("one", "sp", "bug"))
    tol = {k: 2 * one[k] + 2e-3 for k in one}
    figures = {**{f"one_{k}": v for k, v in one.items()}, **{f"sp_{k}": v for k, v in sp.items()},
               "bug_loss": bug["loss"], "steps": len(runs["sp"]["loss"])}
    ok = all(sp[k] <= tol[k] for k in tol) and bug["loss"] > 10 * tol["loss"]
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": "TRL SFTTrainer (tiny Llama, packed prompt/completion rows, completion-only loss, gradient "
                      "accumulation 2) under ulysses_trainer at sp=2, FSDP2, in bf16 on gloo ranks sharing the device "
                      "vs one fp32 process: every step's loss and grad norm within 2x one bf16 process's error + 2e-3 (rel.); "
                      "bug_loss: a per-micro-batch token normaliser, must exceed 10x the loss tolerance"}
