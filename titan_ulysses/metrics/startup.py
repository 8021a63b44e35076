"""The start-up line rank 0 prints once the run is built: what trains, from which weights, on
which layout, batch, device and attention kernel, from which step, and the notes that go
with it (uneven heads, the start record, a fake process group, a dataset path passkey does not read)."""

from __future__ import annotations

from titan_ulysses.config.manager import unread_dataset_path
from titan_ulysses.distributed.heads import uneven_note
from titan_ulysses.models.registry import num_params
from titan_ulysses.ops.attention import sdpa_priority


def startup_line(config, spec, weights, compute, options, parallel_dims, params: tuple[int, int],
                 global_batch_size: int, microbatches: int, device, step: int, resumed: str,
                 fake_world: int = 0, record_note: str | None = None) -> str:
    """``spec``: the run's (``run_spec.RunSpec``: model, tokenizer, overrides); ``weights``: the WeightSource;
    ``compute`` / ``options``: ComputeOptions / ParallelizeOptions;
    ``params``: (trainable, total); ``resumed``: what the resume changed ("" when none);
    ``fake_world``: the simulated world size under a fake process group (0: a real one)."""
    pd, t, args = parallel_dims, config.training, spec.args
    source = f"{spec.source}, {spec.tokenizer_line()}, weights from {weights.describe()}"
    attention = compute.attn_backend
    if attention == "sdpa":  # which kernel runs first (model.sdpa_backends)
        order = sdpa_priority(compute.sdpa_backends, head_dim=args.head_dim, seq_len=t.seq_len)  # a whole sequence
        attention += f" ({' > '.join(order)})" if order else " (PyTorch's kernel order)"
    trainable, total = params
    lora = options.lora
    notes = [uneven_note(args.n_heads, args.n_kv_heads, pd.sp, pd.tp), record_note, *spec.notes,
             unread_dataset_path(config)]
    return (
        f"titan-ulysses: {num_params(args) / 1e6:.1f}M params, {source}, "
        + (f"LoRA rank {lora.rank} on {','.join(lora.targets)}: "
           f"{trainable / 1e6:.3f}M trainable of {total / 1e6:.1f}M, " if lora is not None else "")
        + f"layout {pd.degrees}{f' with ep {pd.ep} (borrowed)' if pd.ep > 1 else ''}, global batch {global_batch_size} x {t.seq_len} tokens "
        f"({microbatches} microbatch(es)), device {device.type}, attention {attention}, "
        f"starting at step {step}"
        + resumed
        + "".join(f"\noverride: {o}" for o in spec.overrides)
        + (f"\nFAKE process group: rank 0 of {fake_world}; memory and compute are real, "
           f"losses are not" if fake_world else "")
        + "".join(f"\nnote: {n}" for n in notes if n)
    )
