"""Several ranks sharing one GPU (``gpu_suite.py --part correctness``, case
``multiprocess_one_gpu``): which collectives a backend runs on CUDA tensors, and Ulysses
layouts on gloo with CUDA tensors against one process on the same device.

NCCL refuses two ranks on one device; gloo runs the collectives FSDP2 and Ulysses need on
CUDA tensors (torch 2.11), but ``DTensor.full_tensor()`` (a functional all-gather) segfaults
there, so the model check compares each rank's shard with the same slice of the reference.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

from benchmarks.gpu_common import exact_fp32, rel_err


def _rank_main(rank, world, init_file, backend, device_type, task, out_file):
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a segfaulting rank prints where it was
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = task[0](torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu"), *task[1:])
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def spawn(world: int, backend: str, device_type: str, task: tuple, timeout: float) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        ctx = mp.spawn(_rank_main, args=(world, os.path.join(d, "store"), backend, device_type, task, out),
                       nprocs=world, join=False)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):  # join returns as soon as any one rank exits
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    return {"error": f"no answer within {timeout:.0f} s (hung)"}
        except Exception as e:  # a rank died (e.g. NCCL aborting the process)
            return {"error": f"a rank died: {str(e).strip().splitlines()[-1][:200]}"}
        if not os.path.exists(out):
            return {"error": "rank 0 wrote no result"}
        with open(out) as f:
            return json.load(f)


def probe_collectives(device) -> dict:
    """Which collectives this process group runs correctly on ``device`` tensors."""
    import torch.distributed as dist

    r, w = dist.get_rank(), dist.get_world_size()
    checks = {
        "all_reduce": lambda: _check(lambda t: dist.all_reduce(t), torch.full((4,), r + 1.0, device=device),
                                     torch.full((4,), w * (w + 1) / 2)),
        "all_gather_into_tensor": lambda: _gather(device, r, w),
        "reduce_scatter_tensor": lambda: _scatter(device, r, w),
        "all_to_all_single": lambda: _a2a(device, r, w, functional=False),
        "funcol.all_to_all_single": lambda: _a2a(device, r, w, functional=True),
        "broadcast": lambda: _check(lambda t: dist.broadcast(t, 0), torch.full((4,), float(r), device=device),
                                    torch.zeros(4)),
    }
    found = {}
    for name, fn in checks.items():
        try:
            found[name] = "ok" if fn() else "wrong result"
        except Exception as e:
            found[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return found


def _check(op, t, expected) -> bool:
    op(t)
    return torch.equal(t.cpu(), expected)


def _gather(device, r, w) -> bool:
    import torch.distributed as dist

    out = torch.empty(2 * w, device=device)
    dist.all_gather_into_tensor(out, torch.full((2,), float(r), device=device))
    return torch.equal(out.cpu(), torch.arange(w, dtype=torch.float).repeat_interleave(2))


def _scatter(device, r, w) -> bool:
    import torch.distributed as dist

    out = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(out, torch.arange(2 * w, dtype=torch.float, device=device))
    return torch.equal(out.cpu(), w * torch.arange(2 * r, 2 * r + 2, dtype=torch.float))


def _a2a(device, r, w, functional: bool) -> bool:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(w, dtype=torch.float, device=device) + 10 * r  # element j goes to rank j
    if functional:
        out = funcol.all_to_all_single(x, None, None, dist.group.WORLD).wait()
    else:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
    return torch.equal(out.cpu(), 10 * torch.arange(w, dtype=torch.float) + r)


def model_equality(device, layout: dict, steps: int, options: dict | None = None, lora: bool = False) -> dict:
    """The parallel model on ``device`` against one process on the same device: fp32, AdamW steps.

    ``options``: ParallelizeOptions fields (head stages, AC); ``lora``: adapters on every projection,
    the same on both (B random, so the adapters change the function), the base frozen."""
    import torch.distributed as dist
    from model_harness import clean_name, make_batch, parallel_step, reference_step, small_args

    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.distributed.utils import load_full_state_dict
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions, parallelize_decoder

    exact_fp32()
    pd = ParallelDims(**layout, world_size=dist.get_world_size())
    pd.build_mesh(device.type)
    args = small_args(dim=128, n_heads=8, n_kv_heads=2, ffn_hidden_dim=256)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights()
    with torch.no_grad():  # sharp attention: a head on the wrong rank or stage moves the loss
        for layer in ref.layers.values():
            layer.attention.wq.weight.mul_(4), layer.attention.wk.weight.mul_(4)
    lora_options = None
    if lora:
        from titan_ulysses.distributed.lora import LoRAOptions, apply_lora, init_lora

        lora_options = LoRAOptions(rank=4, alpha=8.0)
        apply_lora(ref, lora_options, torch.float32)
        init_lora(ref, seed=1)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ref.to(device)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_decoder(model, pd, ParallelizeOptions(param_dtype=torch.float32, lora=lora_options, **(options or {})))
    model.to_empty(device=device)
    model.init_buffers(device)
    load_full_state_dict(model, ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def shard_err(t, ref_t) -> float:
        """This rank's shard against the same slice of the reference (gathering DTensors
        through functional collectives segfaults on gloo with CUDA tensors, torch 2.11)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if not isinstance(t, DTensor):
            return rel_err(t, ref_t)
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if local.numel() == 0:
            return 0.0
        return rel_err(local, ref_t[tuple(slice(o, o + n) for o, n in zip(offset, shape))])

    for step in range(steps):
        inputs, labels = (t.to(device) for t in make_batch(step, 4, 77, args.vocab_size))  # 77: sp pads
        ref_loss = reference_step(ref, inputs, labels)
        loss, _ = parallel_step(model, pd, inputs, labels)
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            ref_grad = ref_params[clean_name(name)].grad
            if (p.grad is None) != (ref_grad is None):
                raise AssertionError(f"{name}: a gradient on one side only (frozen parameters must match)")
            if ref_grad is not None:
                worst["grad"] = max(worst["grad"], shard_err(p.grad, ref_grad))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    for name, p in model.named_parameters():
        worst["param"] = max(worst["param"], shard_err(p.detach(), dict(ref.named_parameters())[clean_name(name)]))
    for key in worst:  # the worst over every rank's shards
        t = torch.tensor([worst[key]], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst[key] = t.item()
    return worst


def ulysses_only_equality(device) -> dict:
    """sp=2 without FSDP (for a backend that lacks FSDP's collectives on ``device``): the Ulysses
    exchange only, gradients summed over the sp ranks with all_reduce, against one process."""
    import torch.distributed as dist
    from model_harness import make_batch, reference_step, small_args

    from titan_ulysses.data.sharding import shard_batch
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.distributed.ulysses import apply_ulysses
    from titan_ulysses.models.decoder.model import Transformer
    from titan_ulysses.ops.loss import cross_entropy_sum

    exact_fp32()
    pd = ParallelDims(sp=2, world_size=2)
    pd.build_mesh(device.type)
    args = small_args(dim=128, n_heads=8, n_kv_heads=2, ffn_hidden_dim=256)
    torch.manual_seed(0)
    ref = Transformer(args)
    ref.init_weights()
    model = Transformer(args)
    model.load_state_dict(ref.state_dict())
    ref.to(device), model.to(device)
    apply_ulysses(model, pd.get_mesh("sp"))
    inputs, labels = (t.to(device) for t in make_batch(0, 4, 77, args.vocab_size))
    ref_loss = reference_step(ref, inputs, labels)
    mb = shard_batch(inputs, labels, dist.get_rank(), 2)
    n_tokens = (labels != -100).sum()
    loss = cross_entropy_sum(model(mb.tokens, positions=mb.positions), mb.labels) / n_tokens
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = {"loss": abs(total.item() - ref_loss.item()) / abs(ref_loss.item()), "grad": 0.0}
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        worst["grad"] = max(worst["grad"], rel_err(p.grad, ref_params[name].grad))
    return worst


def multiprocess_one_gpu(ctx):
    """Ranks sharing one GPU: which gloo collectives run on CUDA tensors, whether NCCL allows it,
    and the Ulysses layouts on gloo against one process on the same device."""
    dev = ctx.device.type
    figures, notes = {}, []
    probe = spawn(2, "gloo", dev, (probe_collectives,), ctx.timeout(120))
    figures["gloo_collectives"] = probe
    if ctx.cuda:
        nccl = spawn(2, "nccl", dev, (probe_collectives,), ctx.timeout(60))
        figures["nccl_two_ranks_one_gpu"] = nccl.get("error") or {k: v for k, v in nccl.items()}
    ok = True
    # sp3: 8 q heads / 2 kv heads split unevenly (3, 3, 2): the all-to-all with split sizes
    layouts = (("sp2", {"sp": 2}, 2), ("dp_shard2_sp2", {"dp_shard": 2, "sp": 2}, 4), ("sp3_uneven_heads", {"sp": 3}, 3))
    # dry run: one layout runs every line of the case; the others on CPU are test_model_parallel's
    for name, layout, world in layouts[:1] if ctx.dry_run else layouts:
        res = spawn(world, "gloo", dev, (model_equality, layout, 2 if ctx.dry_run else 3), ctx.timeout(240))
        figures[name] = res
        if "error" in res:
            ok = False
            notes.append(f"{name}: {res['error']}")
            if name == "sp2":  # FSDP's collectives may be what fails: try the exchange alone
                alone = spawn(2, "gloo", dev, (ulysses_only_equality,), ctx.timeout(120))
                figures["sp2_ulysses_only"] = alone
                notes.append("sp2 without FSDP: " + (alone.get("error") or (
                    "equal" if alone["loss"] < 1e-5 and alone["grad"] < 1e-4 else "NOT equal")))
        else:
            ok &= res["loss"] < 1e-5 and res["grad"] < 1e-4 and res["param"] < 1e-5
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": "; ".join(notes) or "fp32 model (dim 128, 8/2 heads, S=77; sp3 splits them unevenly) on gloo "
                                         "ranks sharing the device vs one process; tolerances loss 1e-5, grad 1e-4, "
                                         "params 1e-5 (rel.)"}


# ---- ranks sharing the GPU: head stages, LoRA, cp against one process ------------------------

def features_multirank(ctx):
    """Head-staged Ulysses (AC full) and LoRA on gloo ranks sharing the device, each against
    one process on the same device (fp32, AdamW steps, trained-like attention weights)."""
    # not cp: its K/V all-gather is a functional collective, which segfaults on gloo with CUDA tensors
    # (torch 2.11; seen on the H200 on 2026-11-26); cp's kernels are the attention cases' here and its
    # layouts test_context_parallel's on CPU
    cases = (("sp2_head_stages2_ac_full", {"sp": 2}, 2, {"ulysses_head_stages": 2, "ac_mode": "full"}, False),
             ("sp2_lora", {"sp": 2}, 2, {}, True))
    figures, notes, ok = {}, [], True
    for name, layout, world, options, lora in cases:
        res = spawn(world, "gloo", ctx.device.type, (model_equality, layout, 2, options, lora), ctx.timeout(150))
        figures[name] = res
        if "error" in res:
            ok = False
            notes.append(f"{name}: {res['error']}")
        else:
            ok &= res["loss"] < 1e-5 and res["grad"] < 1e-4 and res["param"] < 1e-5
    return {"status": "pass" if ok else "fail", "figures": figures,
            "detail": "; ".join(notes) or "fp32 model (dim 128, 8/2 heads, S=77, wq/wk x4) on gloo ranks sharing the "
                                         "device vs one process, 2 AdamW steps; loss 1e-5, grads 1e-4, params 1e-5 (rel.)"}
