"""The peer our step is measured against: a transformers training loop as its users write it.

    python -m benchmarks.peer_transformers --config train_configs/llama3_1b_long.toml --seq-len 16384 \\
        --ac full --compile on --extra "--model.tokenizer byte"          # one line of JSON

``LlamaForCausalLM`` (any family ``hf_config`` exports) of the same shape as our config's model
(its ``config.json`` written from our model arguments), random init, fp32 weights under bf16
autocast, SDPA attention, non-reentrant gradient checkpointing on every layer (``--ac full``) or
none, each decoder layer compiled with ``layer.compile()`` (``--compile on``), torch's AdamW
(fused on CUDA), one sequence of ``--seq-len`` tokens per step, the same batch every step.
Each step ends in ``loss.item()`` (what a loop that logs its loss does), so steps are timed
whole; the first ``--warmup`` are dropped, the median of the rest is reported with MFU by
``metrics/flops.py`` (the count our step line uses) and the peak reserved memory. Out of
memory is a result (``"oom": true``), not an error. No code of ours runs inside the loop.

``--liger``: the same loop after Liger-Kernel's ``apply_liger_kernel_to_llama`` (fused linear
cross-entropy, RMSNorm, SwiGLU, RoPE), the strongest loop a transformers user writes today; needs
CUDA and ``liger-kernel`` (``"unavailable"`` says which is missing).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time

import torch


def liger_problem(device: torch.device) -> str:
    """Why the Liger column cannot run here ("" when it can)."""
    import importlib.util

    if device.type != "cuda":
        return "Liger-Kernel's kernels need CUDA"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'titan-ulysses[liger]'; scripts/gpu_wheels.sh carries it)"
    return ""


def build_peer(config_argv: list[str], device: torch.device, ac: str, compile_on: bool, liger: bool = False):
    """(transformers model, our model arguments): the same shape as our config's model, fp32 weights;
    ``liger``: Liger-Kernel's Llama patch applied first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)

    from titan_ulysses.config.manager import load_config
    from titan_ulysses.interop.hf_export import hf_config
    from titan_ulysses.models.resolve import model_args

    loaded = load_config(config_argv)
    args = model_args(loaded, 0)
    cfg = hf_config(args, torch.float32, max_position_embeddings=max(loaded.training.seq_len, 8192))
    hf = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype")})
    hf._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    if ac == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif ac != "none":
        raise SystemExit(f"--ac {ac!r}: the peer has 'full' (checkpointing on every layer) or 'none'")
    if compile_on:
        for layer in model.model.layers:
            layer.compile()
    return model, args


def run_peer(config_argv: list[str], seq_len: int, ac: str, compile_on: bool, steps: int, warmup: int,
             device: torch.device, lr: float = 1e-4, liger: bool = False) -> dict:
    """Train ``steps`` steps; tokens/s (median after ``warmup``), MFU, peak memory and the losses."""
    from titan_ulysses.metrics.flops import flops_per_token, peak_flops

    cuda = device.type == "cuda"
    if liger and liger_problem(device):
        return {"unavailable": liger_problem(device), "ac": ac}
    model, args = build_peer([*config_argv, "--training.seq_len", str(seq_len)], device, ac, compile_on, liger)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(args.vocab_size, 256), (1, seq_len), generator=gen).to(device)  # [1, S]
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(steps):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        return {"oom": True, "ac": ac, "steps_done": len(losses),
                "peak_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}
    step_s = statistics.median(times[warmup:] or times)
    tok_s = seq_len / step_s
    peak = peak_flops(device)
    return {"oom": False, "ac": ac, "compile": compile_on, "seq_len": seq_len, "tok_s": tok_s, "step_s": step_s,
            "mfu_pct": 100 * tok_s * flops_per_token(args, seq_len) / peak if peak else None,
            "peak_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None, "losses": losses,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "device": torch.cuda.get_device_name(device) if cuda else "CPU", "torch": torch.__version__,
            "liger": liger}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--ac", default="full", choices=["full", "none"])
    p.add_argument("--compile", default="on", choices=["on", "off"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--liger", action="store_true", help="apply Liger-Kernel's Llama patch first (CUDA)")
    p.add_argument("--extra", default="", help="overrides of our config that shape the model, one quoted string")
    a = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out = run_peer(["--config", a.config, *shlex.split(a.extra)], a.seq_len, a.ac, a.compile == "on", a.steps,
                   a.warmup, device, liger=a.liger)
    print("PEER " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
