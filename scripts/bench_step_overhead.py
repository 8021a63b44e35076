"""Our trainer's whole step against a bare loop of transformers + AdamW on the same model, interleaved.

    python scripts/bench_step_overhead.py --hf-folder DIR [--seq-len 1026] [--threads 2] [--rounds 5]

One process, fp32, one sequence of ``--seq-len`` tokens per step. ``DIR`` is a Hugging Face
folder (config.json; its safetensors and tokenizer.json when there, random weights and the
byte tokenizer otherwise). Both sides step the same model with the same AdamW settings (lr,
betas, eps, weight decay) and clip at the same ``training.max_norm``:

* ours: ``Trainer.train_step`` (data, ``forward_backward``, clip, the guard, AdamW, schedule);
* bare: ``model(input_ids, labels=...).loss.backward()``, ``clip_grad_norm_``,
  ``AdamW.step()``, ``zero_grad()`` with torch's default AdamW for the device.

Each round times one step of each, alternating (after ``--warmup`` rounds), so drifts in the
machine's load reach both alike. Within each step the forward and backward are timed too (ours:
the trainer's own ``forward_backward`` call), so what surrounds the model shows per step:
the step minus its forward and backward. Prints medians, the ratio, the device and the
command. ``--profile`` prints torch.profiler's top operators of one of our steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU ({model}), {torch.get_num_threads()} threads, {os.cpu_count()} cores visible"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_ours(folder: str, seq_len: int, dump: str):
    """Our Trainer on ``folder`` as one process, fp32, one sequence per step, nothing saved."""
    from titan_ulysses.config.manager import load_config
    from titan_ulysses.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    tokenizer = ["--model.tokenizer", "hf"] if os.path.isfile(os.path.join(folder, "tokenizer.json")) else []
    argv = ["--config", os.path.join(ROOT, "train_configs/debug_model.toml"), "--model.hf_assets_path", folder,
            *tokenizer, "--parallelism.ulysses_degree", "1", "--training.seq_len", str(seq_len),
            "--training.local_batch_size", "1", "--training.global_batch_size", "1",
            "--training.mixed_precision_param", "float32", "--training.steps", "100000",
            "--checkpoint.enable", "false", "--metrics.log_freq", "100000", "--job.dump_folder", dump]
    return Trainer(load_config(argv))


def build_bare(folder: str, trainer):
    """transformers' model of ``folder`` with torch's default AdamW at the trainer's settings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    has_weights = any(f.endswith(".safetensors") for f in os.listdir(folder))
    if has_weights:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.to(trainer.device).train()
    o = trainer.config.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
    return model, opt


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-folder", required=True)
    p.add_argument("--seq-len", type=int, default=1026)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of each side per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--profile", action="store_true", help="print the top operators of one of our steps")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dump = tempfile.mkdtemp(prefix="bench_step_overhead_")
    trainer = build_ours(a.hf_folder, a.seq_len, dump)
    model, opt = build_bare(a.hf_folder, trainer)
    max_norm = trainer.config.training.max_norm
    data = iter(trainer.dataloader)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, a.seq_len), generator=g).to(trainer.device)

    import titan_ulysses.trainer as trainer_module

    inside = {}  # this round's forward and backward time within each side's step
    real_forward_backward = trainer_module.forward_backward

    def timed_forward_backward(*args, **kwargs):  # the trainer's own call, timed where it happens
        start = time.perf_counter()
        out = real_forward_backward(*args, **kwargs)
        inside["ours"] = time.perf_counter() - start  # (no device sync: CPU, or a GPU step's host side)
        return out

    trainer_module.forward_backward = timed_forward_backward

    def bare_step():
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        inside["bare"] = time.perf_counter() - start
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    cases = {"ours": lambda: trainer.train_step(data), "bare": bare_step}
    step, around = {side: [] for side in cases}, {side: [] for side in cases}
    for r in range(a.warmup + a.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))  # neither side always goes first
        line = {}
        for side in order:
            t = timed(cases[side])
            line[side] = f"{side} step {t:.2f} s, around the model {t - inside[side]:.2f} s"
            if r >= a.warmup:
                step[side].append(t)
                around[side].append(t - inside[side])
        print(f"round {r + 1}{' (warm-up)' if r < a.warmup else ''}: {'; '.join(line[s_] for s_ in cases)}", flush=True)
    med = {side: statistics.median(v) for side, v in step.items()}
    med_around = {side: statistics.median(v) for side, v in around.items()}
    print(f"device: {device_name()}; torch {torch.__version__}")
    print(f"command: python scripts/bench_step_overhead.py {shlex.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model: {a.hf_folder} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), "
          f"{a.seq_len} tokens per step, fp32; medians of {a.rounds} interleaved rounds")
    for side in cases:
        print(f"  {side} step {med[side]:7.3f} s (min {min(step[side]):.3f}, max {max(step[side]):.3f}); "
              f"around the model {med_around[side]:.3f} s (step minus its forward and backward)")
    print(f"ratio ours / bare, whole step: {med['ours'] / med['bare']:.3f}")
    print(f"around the model, ours - bare: {med_around['ours'] - med_around['bare']:+.3f} s per step")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(data)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())
