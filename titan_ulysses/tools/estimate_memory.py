"""Per-device memory of a training config, the longest sequence that fits, and a layout that fits.

    python scripts/estimate_memory.py --config train_configs/llama3_8b_128k.toml --world-size 8
    python scripts/estimate_memory.py --config train_configs/llama3_8b_128k.toml --world-size 8 \\
        --training.seq_len 1048576 --device-memory-gib 80
    python scripts/estimate_memory.py --config train_configs/debug_model.toml --world-size 1 \\
        --parallelism.ulysses_degree 1 --validate

The model of what is kept is ``titan_ulysses/planning/estimate.py`` (docs/memory_model.md). The
recommendation tries the ranks per sequence smallest first (fewest exchanges; it weighs memory only,
so Llama-3-8B at 128K on 8 GPUs gets ``ulysses_degree 1`` with full AC and a tiled MLP, while the
shipped config runs sp=8: half the memory, room for selective AC, one sequence per step --
docs/parallelism.md, "When sp wins") (Ulysses where the heads allow,
ulysses x context_parallel where they do not, on every attention backend the registry says runs
under cp) and adds memory
switches in the order of the user guide until the estimate fits in 90% of the device
(the rest: CUDA context, NCCL, fragmentation); FSDP CPU offload comes in only where no
split fits without it.

``--track`` (any machine, seconds, no memory) runs a steady-state step of this config as
rank 0 of the simulated world under ``FakeTensorMode`` and PyTorch's ``FSDPMemTracker``
(``titan_ulysses/planning/track.py``) and prints its peak per phase and, at the
peak, per kind (parameters, gradients, optimizer state, activations, temporaries, FSDP
buffers) beside the estimate's phases. It cannot see what only CUDA allocates: kernels'
workspaces (cuBLAS; flash / cuDNN attention backward's fp32 dq accumulator and, with GQA,
dk/dv expanded to the q heads), NCCL buffers, the caching allocator's rounding and
fragmentation, torch.compile's buffers (the step is eager; attention is sdpa, choosing its
kernels as on CUDA). Host memory is tracked apart from the device's: ``full_offload``'s
block inputs and, with FSDP CPU offload, the sharded parameters, gradients and optimizer
state (``planning/track.py`` says how). Models of more than four layers are traced at three
and four layers, and long sequences at short lengths that are multiples of every chunk size,
checked on a third, and extrapolated (``planning/extrapolate.py``); the output says
what was traced. ``--validate`` runs two real steps and compares: on CUDA the second
(steady-state) step's whole peak (``torch.cuda.max_memory_allocated``, one process; in
fake mode for a world size above 1; measured on an H200, see docs/benchmarks.md); on CPU
the saved activations, counted through autograd's saved-tensor hooks (single process,
sp = 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

from titan_ulysses.config.manager import ConfigError, load_config
from titan_ulysses.models.registry import num_params
from titan_ulysses.planning.estimate import estimate, largest_seq_len
from titan_ulysses.planning.inputs import GIB, Switches, from_config
from titan_ulysses.planning.recommend import BUDGET, devices_that_fit, recommend
from titan_ulysses.preflight import validate
from titan_ulysses.run_spec import resolve_run

def saved_bytes(model, tokens, positions=None) -> int:
    """Bytes autograd keeps for backward in ``model(tokens, labels=tokens)``, parameters excluded."""
    from torch.autograd.graph import saved_tensors_hooks

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        t = getattr(t, "elem", t)  # a functional collective's result wraps its tensor
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions=positions, labels=tokens)
    return sum(seen.values())


def measure_saved_activations(args, switches: Switches, seq_len: int, batch: int) -> float:
    """What one forward of the model on CPU keeps for backward (the estimate's saved terms)."""
    import torch

    from titan_ulysses.distributed.activation_checkpoint import apply_ac
    from titan_ulysses.models.compute import ComputeOptions
    from titan_ulysses.models.registry import build_model

    if switches.ac_mode == "selective":
        raise SystemExit("--validate on CPU measures through saved-tensor hooks, which selective AC bypasses; "
                         "use activation_checkpoint.mode none, full or full_offload")
    from titan_ulysses.planning.fake_step import cuda_kernel_choices

    dtype = torch.float32 if switches.act_bytes == 4 else torch.bfloat16
    compute = ComputeOptions(mlp_tile_size=switches.mlp_tile_size, loss_chunk_size=switches.loss_chunk_size,
                             loss_backend=switches.loss_backend if switches.loss_backend in ("chunked", "materialized")
                             else "fused")
    model = build_model(args, compute).to(dtype)
    apply_ac(model, "full" if switches.ac_mode == "full_offload" else switches.ac_mode)
    with cuda_kernel_choices():  # the kernels CUDA would run (fp32 GQA: kv heads expanded)
        return float(saved_bytes(model, torch.randint(0, args.vocab_size, (batch, seq_len))))


def estimated_saved_activations(args, layout, switches: Switches, seq_len: int, batch: int) -> float:
    """The estimate's counterpart of ``measure_saved_activations``: that model has no FSDP (so no per-block
    bf16 copy of the RoPE tables), keeps full_offload's block inputs on the CPU it runs on, and without
    keeps the loss's own: materialized its fp32 log-probabilities, fused the output weight's fp32 [V, D]
    gradient made in forward (none when frozen; its [T, D] one in place of the final norm's output)."""
    mode = "full" if switches.ac_mode == "full_offload" else switches.ac_mode
    est = estimate(args, layout, dataclasses.replace(switches, ac_mode=mode), seq_len, batch)
    tokens = batch * seq_len
    fused = 0 if switches.lora_rank else 4 * args.vocab_size * args.dim
    logits = {"materialized": tokens * args.vocab_size * 4, "chunked": 0}.get(switches.loss_backend, fused)
    rope = args.n_layers * switches.act_bytes * args.head_dim * tokens if switches.act_bytes < 4 else 0
    return est.saved_activations + logits - rope


@contextlib.contextmanager
def _block_progress(passes: int, desc: str):
    """A tqdm bar on stderr over the transformer blocks' forwards (``passes``: one step at each depth
    and length the tracker traces; recomputation under activation checkpointing counts again, and so
    does a step traced at the full length where the short ones are off their line: the bar may pass
    its total)."""
    import torch
    from tqdm import tqdm

    bar = tqdm(total=passes, desc=desc, unit="block", file=sys.stderr, leave=True, dynamic_ncols=True)

    def count(module, args, output):
        if type(module).__name__.endswith("TransformerBlock"):
            bar.update()

    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        yield bar
    finally:
        handle.remove()
        bar.close()


def track(args, layout, switches, seq_len: int, batch: int, est) -> dict:
    """The CPU tracker's step (``planning/track.py``) beside the estimate, phase by phase."""
    from titan_ulysses.planning.track import track_step
    from titan_ulysses.planning.extrapolate import sample_lengths, tracked_layer_counts

    k = switches.ac_layers_per_checkpoint
    # a step's block forwards: each block's, and a group's recompute runs its blocks but the last again
    forwards = {d: d + (d - -(-d // k) if k > 1 else 0) for d in tracked_layer_counts(args.n_layers, group=k)}
    lengths = sample_lengths(seq_len, layout, switches)[0]
    passes = sum(forwards.values()) * (2 if len(lengths) > 1 else 1) + \
        (forwards[max(forwards)] if len(lengths) > 1 else 0)  # samples x depths, and the check
    try:
        with _block_progress(passes * switches.microbatches, "--track: block forwards"):
            step = track_step(args, layout, switches, seq_len, batch)
    except ValueError as e:
        raise SystemExit(f"--track: {e}") from e
    phases = step.summary()
    return {"what": "peak memory (CPU tracker, fake tensors)", "traced": step.traced,
            "measured": float(step.peak), "phase": step.peak_phase,
            "host": float(step.host_peak), "estimated_host": est.host_offloaded,
            "estimated": est.total, "estimated_phase": est.peak_phase,
            "error_pct": 100 * (est.total - step.peak) / step.peak,
            "phases": {name: {"tracked": float(p.peak), "estimated": est.phases.get(name), "at": p.name,
                              "kinds": p.kinds} for name, p in phases.items()}}


def measure_cuda_peak(argv: list[str], world: int) -> float:
    """Peak allocated bytes of a steady-state training step (the second) on this GPU (fake process group for world > 1)."""
    import torch

    from titan_ulysses.trainer import Trainer

    extra = ["--comm.mode", "fake", "--comm.fake_world_size", str(world)] if world > 1 else []
    trainer = Trainer(load_config([*argv, *extra, "--checkpoint.enable", "false",
                                   "--training.allow_over_memory_estimate", "true"]))  # measured, not planned
    data = iter(trainer.dataloader)
    trainer.train_step(data)  # the first step allocates the optimizer state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(data)
    return float(torch.cuda.max_memory_allocated())


def prepare(config_argv: list[str], world_size: int):
    """(config, spec, layout): the model as train.py resolves it (``run_spec``), without reading the tokenizer
    (this may run where its file is absent); SystemExit naming a refusal."""
    try:
        config = load_config(config_argv)
        spec = resolve_run(config, tokenizer=False)
        return config, spec, validate(config, world_size, spec)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs of the job")
    p.add_argument("--device-memory-gib", type=float, default=80.0, help="memory of one device (H100: 80)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--validate", action="store_true", help="also run one step and compare (see above)")
    p.add_argument("--track", action="store_true",
                   help="also track a step's memory on CPU under fake tensors, phase by phase (see above)")
    return p


def _estimated(a, overrides, config, args, layout, switches, est) -> dict:
    """The estimate, the longest sequence that fits 90% of the device and the recommendation, as one dict."""
    t = config.training
    device = a.device_memory_gib * GIB
    longest = largest_seq_len(args, layout, switches, 0.9 * device, t.local_batch_size)
    rec = recommend(args, layout, switches, t.seq_len, t.local_batch_size, a.world_size, BUDGET * device,
                    config.model.attn_backend)
    return {"config": a.config, "overrides": overrides, "world_size": a.world_size, "layout": dataclasses.asdict(layout),
            "seq_len": t.seq_len, "local_batch_size": t.local_batch_size, "switches": dataclasses.asdict(switches),
            "bytes": est.as_dict(), "largest_seq_len": longest,
            "recommendation": None if rec is None else {"ulysses_degree": rec[0], "overrides": rec[1],
                                                        "context_parallel_degree": next(
                                                            (int(f.split()[1]) for f in rec[1]
                                                             if f.startswith("--parallelism.context_parallel_degree")), 1),
                                                        "total_gib": rec[2].total / GIB}}


def _validation(config_argv, world_size: int, args, layout, switches, t, est) -> dict:
    """``--validate``: one step measured (CUDA: its peak; CPU: the saved activations) against the estimate."""
    import torch

    if torch.cuda.is_available():
        measured, what = measure_cuda_peak(config_argv, world_size), "peak memory (CUDA)"
        compared = est.total
    else:
        if layout.sp != 1:
            raise SystemExit("--validate on CPU runs one process: add --parallelism.ulysses_degree 1")
        measured, what = measure_saved_activations(args, switches, t.seq_len, t.local_batch_size), \
            "saved activations (CPU)"
        compared = estimated_saved_activations(args, layout, switches, t.seq_len, t.local_batch_size)
    return {"what": what, "estimated": compared, "measured": measured,
            "error_pct": 100 * (compared - measured) / measured}


def _print_table(a, args, layout, switches, t, est, result: dict) -> None:
    """The human-readable report of ``result``."""
    print(f"{a.config}: {num_params(args) / 1e9:.2f}B params, seq_len {t.seq_len} x local batch {t.local_batch_size}, "
          f"world {a.world_size} = dp_shard {layout.dp_shard} x cp {layout.cp} x sp {layout.sp} x tp {layout.tp}"
          f"{f', experts over ep {layout.ep}' if layout.ep > 1 else ''}, "
          f"AC {switches.ac_mode}, loss {switches.loss_backend} (chunk {switches.loss_chunk_size or 'auto'}), MLP tile {switches.mlp_tile_size}, "
          f"{'bf16' if switches.act_bytes == 2 else 'fp32'} compute")
    for key, value in est.as_dict().items():
        if isinstance(value, float) and key != "total":
            print(f"  {key:<26} {value / GIB:10.2f} GiB")
    print("  phases (total = the largest):")
    for key, value in est.phases.items():
        print(f"    {key:<24} {value / GIB:10.2f} GiB{'  <- peak' if key == est.peak_phase else ''}")
    print(f"  {'total':<26} {est.total / GIB:10.2f} GiB")
    print(f"device memory needed (estimate): {devices_that_fit(est.total)}")
    print(f"largest seq_len fitting 90% of {a.device_memory_gib:g} GiB with this layout and switches: "
          f"{result['largest_seq_len']}")
    rec = result["recommendation"]
    if rec is None:
        print(f"no ulysses_degree within {a.world_size} GPUs and no switch makes seq_len {t.seq_len} fit")
    else:
        print(f"recommended: {' '.join(rec['overrides'])}  ({rec['total_gib']:.1f} GiB)")
        print("  (the fewest ranks per sequence that fit; a larger ulysses_degree leaves room for selective AC, "
              "a smaller global batch and longer sequences: docs/parallelism.md, 'When sp wins')")
    if "tracked" in result:
        tr = result["tracked"]
        print(f"CPU tracker (fake tensors): device peak {tr['measured'] / GIB:.2f} GiB in {tr['phase']}; estimate "
              f"{tr['estimated'] / GIB:.2f} GiB in {tr['estimated_phase']} ({tr['error_pct']:+.1f}%); host peak "
              f"{tr['host'] / GIB:.2f} GiB (estimate {tr['estimated_host'] / GIB:.2f} GiB); {tr['traced']}")
        for name, ph in tr["phases"].items():
            est_text = "" if ph["estimated"] is None else f"  estimated {ph['estimated'] / GIB:8.2f} GiB"
            kinds = ", ".join(f"{k} {v / GIB:.2f}" for k, v in ph["kinds"].items() if v >= GIB / 100)
            print(f"  {name:<22} {ph['tracked'] / GIB:8.2f} GiB{est_text}  ({ph['at']}: {kinds})")
    if "validation" in result:
        v = result["validation"]
        print(f"validation, {v['what']}: estimated {v['estimated'] / GIB:.4f} GiB, measured {v['measured'] / GIB:.4f} GiB, "
              f"error {v['error_pct']:+.1f}%")


def main(argv=None) -> int:
    a, overrides = _parser().parse_known_args(argv)
    config_argv = ["--config", a.config, *overrides]
    config, spec, dims = prepare(config_argv, a.world_size)
    args, layout, switches = from_config(config, dims, spec.args)
    t = config.training
    est = estimate(args, layout, switches, t.seq_len, t.local_batch_size)
    result = _estimated(a, overrides, config, args, layout, switches, est)
    if a.track:  # before --validate: the tracker needs its own (fake) process group
        result["tracked"] = track(args, layout, switches, t.seq_len, t.local_batch_size, est)
    if a.validate:
        result["validation"] = _validation(config_argv, a.world_size, args, layout, switches, t, est)
    if a.json:
        print(json.dumps(result, indent=1))
        return 0
    _print_table(a, args, layout, switches, t, est, result)
    return 0


def cli(argv=None) -> None:
    """The installed command (pyproject.toml's [project.scripts]): a refusal is one line on stderr and exit
    code 2, as train.py's (``SystemExit("...")`` alone would exit 1)."""
    try:
        code = main(argv)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr, flush=True)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    cli()
