"""Where a run stands: elapsed time and ETA for the step lines, and the end-of-run summary."""

from __future__ import annotations

import time


class RunProgress:
    def __init__(self, start_step: int, total_steps: int, tokens_per_step: int):
        self.start_step, self.total_steps, self.tokens_per_step = start_step, total_steps, tokens_per_step
        self.started = time.perf_counter()
        self.last_loss: float | None = None
        self.validation: tuple[int, float] | None = None

    def timing(self, step: int) -> dict:
        """``elapsed_sec`` since this process started training; ``eta_sec`` to the last step at
        this process's mean step time so far (validation and saves included)."""
        elapsed = time.perf_counter() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        return {"elapsed_sec": elapsed, "eta_sec": eta}

    def summary(self, step: int, checkpoint: str | None, metrics_path: str) -> dict:
        wall = time.perf_counter() - self.started
        steps = step - self.start_step
        tokens = steps * self.tokens_per_step
        return {
            "first_step": self.start_step, "last_step": step, "total_steps": self.total_steps,
            "steps_this_run": steps, "tokens_this_run": tokens, "wall_sec": wall,
            "tokens_per_sec": tokens / wall if wall > 0 else 0.0,
            "final_loss": self.last_loss,
            "validation_loss": self.validation[1] if self.validation else None,
            "validation_step": self.validation[0] if self.validation else None,
            "checkpoint": checkpoint, "metrics": metrics_path,
        }
