"""One training step's memory, measured phase by phase on CPU without computing anything.

``track_step`` builds the model as the trainer does (meta device, the family's parallelize, FSDP2 over the
simulated layout) and runs a steady-state step -- forward with the loss, backward, clipping, the fused
AdamW step, ``zero_grad(set_to_none=True)`` -- as rank 0 of a fake process group under ``FakeTensorMode``:
Llama-3-8B at 128K tokens costs seconds and no memory. It mirrors ``Trainer.train_step``, which cannot run
under fake tensors (it reads the loss with ``.item()``). PyTorch's ``FSDPMemTracker`` sorts every storage
by kind and ``phases.py`` keeps each phase's peak; ``fake_step.py`` patches what a CPU step does
differently from a CUDA one. FSDP CPU offload cannot be faked (FSDP2 needs the device's streams): the
step runs without it and counts the sharded parameters, gradients and optimizer state as host memory.
Long deep steps are traced short and shallow and extrapolated exactly (``extrapolate.py``). What the
tracker cannot see (CUDA workspaces, NCCL, the allocator, compile): docs/memory_model.md.
"""

from __future__ import annotations

import torch

from titan_ulysses.planning.fake_step import (
    balanced_experts,
    cuda_kernel_choices,
    fake_world,
    offload_to_fake_host,
    sharding_metadata_unseen,
)
from titan_ulysses.planning.inputs import Layout, Switches
from titan_ulysses.planning.phases import CPU_OFFLOAD_KINDS, PhasePeaks, StepMemory, phase_hooks
from titan_ulysses.models.decoder.args import DecoderArgs


def track_step(args: DecoderArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1,
               extrapolate: bool = True) -> StepMemory:
    """The memory of rank 0 over a steady-state step (the optimizer state exists, gradients do not).

    With ``extrapolate``: traced at three and four layers (more than four), or groups of
    ``Switches.ac_layers_per_checkpoint`` layers, and at short lengths (a long one), each phase
    extrapolated to ``args.n_layers`` and ``seq_len`` (``extrapolate.py``); ``StepMemory.traced``
    says what was traced."""
    import dataclasses

    from titan_ulysses.planning import extrapolate as ex

    if not switches.loss_chunk_size and switches.loss_backend != "materialized":
        # the loss chunk the target length gets (ops/loss: chosen from the token count), at every traced length
        from titan_ulysses.ops.loss import auto_chunk_size

        tokens = local_batch * ex.local_tokens(seq_len, layout)
        switches = dataclasses.replace(switches, loss_chunk_size=auto_chunk_size(tokens, args.vocab_size, args.dim))
    group = switches.ac_layers_per_checkpoint
    depths = ex.tracked_layer_counts(args.n_layers, extrapolate, group)
    lengths, why = ex.sample_lengths(seq_len, layout, switches) if extrapolate else ((seq_len,), "")
    at_depth = {n: dataclasses.replace(args, n_layers=n) for n in depths}
    steps: dict[int, StepMemory] = {}
    if len(lengths) > 1:
        q = ex.token_quantum(layout, switches)
        m = ex.local_tokens(seq_len, layout) // q
        scale = {s: m * q / ex.local_tokens(s, layout) for s in lengths}
        keyed = {(n, s): _track(at_depth[n], layout, switches, s, local_batch, keyed=True, token_scale=scale[s])
                 for n in depths for s in lengths[:2]}
        check = _track(at_depth[depths[-1]], layout, switches, lengths[2], local_batch, keyed=True,
                       token_scale=scale[lengths[2]])
        why = ex.off_the_line(keyed[depths[-1], lengths[0]], keyed[depths[-1], lengths[1]], check) or \
            "".join(ex.off_the_line(keyed[n, lengths[0]], keyed[n, lengths[1]]) for n in depths[:-1])
        if not why:
            steps = {n: ex.at_length(keyed[n, lengths[0]], keyed[n, lengths[1]], m) for n in depths}
            sampled = f"{' and '.join(f'{s:,}' for s in lengths[:2])} tokens (on the line at {lengths[2]:,})"
    if not steps:
        steps = {n: _track(at_depth[n], layout, switches, seq_len, local_batch) for n in depths}
        sampled = f"{seq_len:,} tokens" + (f" (not extrapolated in tokens: {why})" if why else "")
    layers = " and ".join(map(str, depths))
    if len(depths) == 1:
        step = steps[depths[0]]
    else:
        step = ex.to_depth(steps[depths[0]], steps[depths[1]], args.n_layers, group)
    extrapolated = len(depths) > 1 or len(lengths) > 1 and not why
    if group > 1 and len(depths) > 1:
        layers += f" layers (3 and 4 groups of {group}" + \
            (f", the last of {args.n_layers % group})" if args.n_layers % group else ")")
    else:
        layers += " layers"
    step.traced = f"traced at {layers} x {sampled}" + \
        (f", extrapolated to {args.n_layers} layers x {seq_len:,} tokens" if extrapolated else "")
    if args.moe is not None:  # fake tensors have no routing to read (fake_step.balanced_experts)
        m = args.moe
        step.traced += (f"; routing assumed balanced: each of the {m.num_experts} experts gets T x {m.top_k} / "
                        f"{m.num_experts} of a rank's rows" + (f", each of the {layout.ep} ep ranks receives as many "
                                                               f"as it sends" if layout.ep > 1 else ""))
    step.events = None
    return step


def _track(args: DecoderArgs, layout: Layout, switches: Switches, seq_len: int, local_batch: int = 1,
           keyed: bool = False, token_scale: float = 1.0) -> StepMemory:
    """One step traced as it is (``keyed``: with the per-event largest; ``token_scale``: the length this
    trace stands for over ``seq_len``, for the size thresholds)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_ulysses.data.sharding import shard_batch
    from titan_ulysses.distributed.activation_offload import ActivationOffloader

    world = layout.dp_shard * layout.cp * layout.sp * layout.tp
    host_kinds = CPU_OFFLOAD_KINDS if switches.cpu_offload else ()
    crossed: list[str] = []
    with fake_world(world), cuda_kernel_choices(), offload_to_fake_host(ActivationOffloader, token_scale, crossed), \
            sharding_metadata_unseen(), balanced_experts():
        model, pd = _build(args, layout, switches, world)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.init_buffers(torch.device("cpu"))
            optimizer = _steady_state_optimizer(model)
            tokens = torch.zeros(local_batch, seq_len, dtype=torch.long)
            batches = [shard_batch(tokens, tokens, 0, layout.sp, cp=layout.cp) for _ in range(switches.microbatches)]
            poller = _traced_step(model, optimizer, pd, args, batches, host_kinds, keyed)
    return StepMemory(peak=max(p.peak for p in poller.phases.values()), phases=poller.phases,
                      host_peak=poller.host_peak, traced=f"{args.n_layers} layers x {seq_len:,} tokens",
                      events=poller.events, thresholds=sorted(set(crossed)))


def _build(args: DecoderArgs, layout: Layout, switches: Switches, world: int):
    """(model on the meta device, parallelized as the trainer does; its ParallelDims) in the fake world."""
    from titan_ulysses.distributed.lora import LoRAOptions
    from titan_ulysses.distributed.parallel_dims import ParallelDims
    from titan_ulysses.models.decoder.parallelize import ParallelizeOptions
    from titan_ulysses.models.registry import build_model, parallelize_model

    dtype = torch.bfloat16 if switches.act_bytes == 2 else torch.float32
    pd = ParallelDims(dp_shard=layout.dp_shard, cp=layout.cp, sp=layout.sp, tp=layout.tp, ep=layout.ep,
                      world_size=world)
    pd.build_mesh("cpu")
    with torch.device("meta"):
        model = build_model(args, _compute(switches))
    lora = LoRAOptions(rank=switches.lora_rank) if switches.lora_rank else None
    parallelize_model(model, pd, ParallelizeOptions(
        ac_mode=switches.ac_mode, ac_layers_per_checkpoint=switches.ac_layers_per_checkpoint, param_dtype=dtype,
        lora=lora, ulysses_head_stages=switches.head_stages,
        ulysses_stage_keep_attention=switches.stage_keep_attention))
    return model, pd


def _steady_state_optimizer(model):
    """The fused AdamW (as on CUDA) with its state made, without running a step to make it; no gradients left."""
    from titan_ulysses.optim import build_optimizer

    optimizer = build_optimizer(model, "AdamW", 1e-4, 0.1, 1e-8, (0.9, 0.95), "cuda")
    for p in model.parameters():
        if p.requires_grad:  # a frozen base (LoRA) has no gradient, and the optimizer never clears one
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return optimizer


def _traced_step(model, optimizer, pd, args: DecoderArgs, batches, host_kinds, keyed: bool) -> PhasePeaks:
    """Runs one step over ``batches`` under PyTorch's memory tracker; the phases' peaks it saw."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from titan_ulysses.distributed.utils import clip_grad_norm_

    def step(poller, tracker):
        for i, mb in enumerate(batches):
            if i and hasattr(tracker, "reset_mod_stats"):
                tracker.reset_mod_stats()  # FSDPMemTracker refuses a second forward otherwise
            poller.phase = "forward"
            first = torch._C._autograd._get_sequence_nr()
            loss, stats = model(mb.tokens, positions=mb.positions, labels=mb.labels, return_stats=True)
            loss = loss / 1000.0 + _router_loss(stats, pd, args, len(batches))
            del stats  # held, its graph would live on through the backward (AC: every block's inputs)
            poller.forward_nodes = (first, torch._C._autograd._get_sequence_nr())
            poller.phase = "loss backward"
            loss.backward()
        poller.phase = "clip grad norm"
        clip_grad_norm_(model.parameters(), 1.0)
        poller.phase = "optimizer step"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(model, optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    with tracker:
        if hasattr(tracker, "track_inputs"):
            tracker.track_inputs(tuple((mb.tokens, mb.labels, mb.positions) for mb in batches))
        poller = PhasePeaks(tracker, host_kinds, keyed)
        handles = phase_hooks(model, poller)
        try:
            with poller:
                step(poller, tracker)
        finally:
            for h in handles:
                h.remove()
    return poller


def _router_loss(stats, dims, args: DecoderArgs, forwards: int):
    """A mixture of experts' share of the objective, formed as the trainer's step forms it
    (``step.forward_backward``, which the tracker cannot call: it names the loss's backward apart):
    the routing statistics the forward returned, the load-balancing loss over the ``loss`` mesh,
    ``aux_loss_coef`` x it over the step's forwards."""
    from titan_ulysses.step import router_aux_share

    if stats is None or args.moe is None:
        return 0.0
    aux, _ = router_aux_share(stats, dims.get_mesh("loss"))
    coef = args.moe.aux_loss_coef
    return coef * aux / forwards if coef > 0 else 0.0


def _compute(switches: Switches):
    from titan_ulysses.models.compute import ComputeOptions

    # sdpa: the one backend that trains on CPU (flash_attn is CUDA-only, flex has no CPU backward)
    # liger / cce are CUDA kernels with no fake-tensor path: counted as fused (their transients are smaller)
    backend = switches.loss_backend if switches.loss_backend in ("fused", "chunked", "materialized") else "fused"
    return ComputeOptions(loss_chunk_size=switches.loss_chunk_size, mlp_tile_size=switches.mlp_tile_size,
                          attn_backend="sdpa", loss_backend=backend)
