"""Step lines on stdout: loss, rate, memory, elapsed time and ETA; the summary at the end."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``3725.2`` -> ``1h02m05s``; ``65`` -> ``1m05s``; ``7.3`` -> ``7s``."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


class ConsoleLogger:
    def log(self, metrics: dict) -> None:
        step = metrics["step"]
        if "validation_loss" in metrics:
            print(f"step {step:>5}  validation_loss {metrics['validation_loss']:.4f}  "
                  f"tokens {metrics['validation_tokens']:,}", flush=True)
            return
        mfu = metrics.get("mfu")
        print(
            f"step {step:>5}  loss {metrics['loss']:.4f}  "
            + (f"aux_loss {metrics['aux_loss']:.4f}  " if "aux_loss" in metrics else "")
            + (f"expert_load {metrics['expert_load_max_over_mean']:.2f}  "
               if "expert_load_max_over_mean" in metrics else "")
            + f"grad_norm {metrics['grad_norm']:.3f}  "
            f"lr {metrics['lr']:.2e}  tok/s/dev {metrics['tokens_per_sec_per_device']:,.0f}  "
            + (f"mfu {mfu:.1f}%  " if mfu is not None else "")
            + f"mem {metrics['max_memory_gib']:.2f} GiB"
            + (f"  loss_tokens {metrics['loss_tokens']:,}  pad {100 * metrics['padding']:.1f}%"
               if "loss_tokens" in metrics else "")
            + (f"  truncated {metrics['truncated']}" if metrics.get("truncated") else "")
            + (f"  dropped {metrics['dropped']}" if metrics.get("dropped") else "")
            + (f"  data_wait {1e3 * metrics['data_wait_sec']:.0f}ms" if "data_wait_sec" in metrics else "")
            + (f"  elapsed {duration(metrics['elapsed_sec'])}" if "elapsed_sec" in metrics else "")
            + (f"  eta {duration(metrics['eta_sec'])}" if "eta_sec" in metrics else ""),
            flush=True,
        )

    def log_summary(self, summary: dict) -> None:
        s = summary
        if s["steps_this_run"] == 0:  # the trainer's start-up line said so, naming training.steps
            return
        lines = [f"run summary: {s['steps_this_run']} steps this run (step {s['first_step']} -> {s['last_step']} "
                 f"of {s['total_steps']}), {s['tokens_this_run']:,} tokens in {duration(s['wall_sec'])}, "
                 f"{s['tokens_per_sec']:,.0f} tokens/s"]
        if s.get("final_loss") is not None:
            lines.append(f"  final loss {s['final_loss']:.4f}"
                         + (f", validation loss {s['validation_loss']:.4f} (step {s['validation_step']})"
                            if s.get("validation_loss") is not None else ""))
        if s.get("checkpoint"):
            lines.append(f"  checkpoint: {s['checkpoint']}")
        lines.append(f"  metrics: {s['metrics']}")
        print("\n".join(lines), flush=True)

    def close(self) -> None:
        pass
