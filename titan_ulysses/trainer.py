"""The training loop: build (checks, mesh, data, model, optimizer, checkpoint) -> loop (step, log,
evaluate, checkpoint). Each part is built by its package's builder; this file only orders them."""

from __future__ import annotations

import math
import os
import signal
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.build import build_checkpointer, load_weights, lock_run_folders
from titan_ulysses.checkpoint.errors import RunRefused
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, resolved_global_batch_size
from titan_ulysses.config.resume import overrides, resume_changes, resume_settings
from titan_ulysses.data.build import build_data
from titan_ulysses.data.microbatches import StepBatches
from titan_ulysses.data.prefetch import StepStream
from titan_ulysses.distributed.float8 import precompute_float8_scales
from titan_ulysses.distributed.lora import parameter_counts
from titan_ulysses.distributed.setup import build_mesh, join_job
from titan_ulysses.distributed.ulysses import stop_slice_checks
from titan_ulysses.distributed.utils import clip_grad_norm_, dist_sum
from titan_ulysses.distributed.watchdog import set_timeouts
from titan_ulysses.heldout import build_validator
from titan_ulysses.metrics.logger import build_metrics_logger
from titan_ulysses.metrics.profiling import StepGC, StepProfiler
from titan_ulysses.metrics.startup import startup_line
from titan_ulysses.metrics.step_log import StepLog
from titan_ulysses.metrics.system import WaitTimer
from titan_ulysses.models.build import build_parallel_model
from titan_ulysses.optim import build_optimizers, follow_config
from titan_ulysses.preflight import check_device, check_launch
from titan_ulysses.step import GuardValues, StepGuard, StepLoss, forward_backward, optimizer_step, takes_found_inf


class LoggedCounts(NamedTuple):
    """What a logging step reads with its guard (:meth:`Trainer._log_counts`), in this order."""

    padding: float
    """Padding tokens of the step's batches (over dp)."""
    tokens: float
    """Tokens of the step's batches, padding included (over dp)."""
    truncated: float
    """Samples cut to fit training.seq_len (over dp)."""
    loss_tokens: float
    """Tokens that carry a loss in the global batch."""
    expert_load: float | None = None
    """A mixture of experts: the busiest expert's assignments over the mean (summed over layers); 1 is balanced."""


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or the learning rate of a step is NaN/inf: the run stops
    before the optimizer touches the weights."""


class Trainer:
    """``Trainer(config)`` builds the run (collective: every rank constructs it); ``train()`` runs it."""

    def __init__(self, config: JobConfig):
        self.config = config
        record_note = self._join(config)
        self._build_data(config)
        options = self._build_model(config)
        self._start_from(config, options)
        self._build_reporting(config, options, record_note)

    def _join(self, config: JobConfig) -> str | None:
        """Everything that can refuse the run, before any process group; then this rank joins the job and the mesh,
        locks the run's folders and seeds. Returns the start record's note for the start-up line."""
        self.parallel_dims, self.spec, record_note = check_launch(config)
        pd = self.parallel_dims
        self.fake = config.comm.mode == "fake"
        self.device = join_job(config)
        check_device(config, pd, self.device, self.spec.args)
        build_mesh(config, pd, self.device)
        self.rank = dist.get_rank()
        self.locks = lock_run_folders(config, self.rank)
        if config.training.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(config.training.seed)
        return record_note

    def _build_data(self, config: JobConfig) -> None:
        """The batch sizes, the tokenizer's data and the steps of this rank's microbatches, prepared ahead."""
        t, pd = config.training, self.parallel_dims
        dp = pd.get_mesh("dp")
        self.global_batch_size = resolved_global_batch_size(config, dp.size())
        self.accumulation_steps = self.global_batch_size // (t.local_batch_size * dp.size())
        self.tokenizer = self.spec.tokenizer_object
        self.data = build_data(config, self.tokenizer, dp.get_local_rank(), dp.size(), self.global_batch_size,
                               fake=self.fake)
        self.use_doc_mask = self.data.packed  # packed rows hold several documents: attention masks per document
        self.data_wait = WaitTimer()
        sp, cp = pd.get_mesh("sp"), pd.get_mesh("cp")
        self.batches = StepBatches(self.accumulation_steps, sp.get_local_rank(), sp.size(), cp.get_local_rank(),
                                   cp.size(), self.device, self.use_doc_mask, self.tokenizer.pad_id)
        # steps prepared ahead by a thread; its state (checkpointed) is the loader's after the steps consumed
        self.dataloader = StepStream(self.data.dataloader, self.batches, t.prefetch_batches)

    def _build_model(self, config: JobConfig):
        """The model laid out on the mesh, and its optimizer and schedule; returns how it was laid out."""
        self.args = self.spec.args
        self.model, self.compute, options = build_parallel_model(config, self.args, self.parallel_dims, self.device)
        self.float8 = options.float8
        self.trainable_params, self.total_params = parameter_counts(self.model)
        self.optimizer, self.lr_scheduler = build_optimizers(config, self.model, self.device)
        return options

    def _start_from(self, config: JobConfig, options) -> None:
        """The checkpointer and the weights the run starts from; on a resume, the config wins over the restored
        optimizer and schedule, and a changed model setting is refused unless checkpoint.override_recorded lists it."""
        self.checkpointer = build_checkpointer(config, self.model, self.optimizer, self.lr_scheduler,
                                               self.dataloader, self.args, options.lora)
        try:  # a checkpoint of other settings is refused before the load (checkpoint/fit.py)
            self.weights = load_weights(config, self.checkpointer, self.model, self.args, self.device,
                                        lora=options.lora is not None)
        except (ConfigError, RunRefused):
            self._release_locks()
            raise
        self.step = self.weights.step
        resumed = ""
        if self.step > 0:
            try:
                changes = resume_changes(self.checkpointer.loaded_settings, resume_settings(config), overrides(config))
            except ConfigError:
                self.checkpointer.close()
                self._release_locks()
                raise
            follow_config(self.optimizer, self.lr_scheduler, config)
            resumed = f"; resumed: {changes}"
        self.resumed = resumed  # what the resume changed, as the start-up line says it

    def _build_reporting(self, config: JobConfig, options, record_note: str | None) -> None:
        """The step guard's state, the loggers, the step line, held-out evaluation and rank 0's start-up line."""
        t, pd = config.training, self.parallel_dims
        self.nonfinite_in_a_row = 0
        # the skip decision stays on the device (fused AdamW's found_inf); the foreach AdamW (a device
        # that is neither CUDA nor CPU) takes none, and its step is read on the host as with sync_free_step false
        self.sync_free = t.sync_free_step and takes_found_inf(self.optimizer)
        self.pending: StepGuard | None = None
        """The last step's guard, not read yet (sync_free_step): read before the next update."""
        self._signalled = False  # SIGTERM / SIGUSR1 reached this rank
        self.preempted = False
        """Some rank was signalled before this step's guard read: every rank saves this step and stops."""
        try:
            self.metrics = build_metrics_logger(config, self.rank, resumed=self.step > 0)
        except ConfigError:
            self._release_locks()  # the run never starts
            raise
        params = (self.trainable_params, self.total_params)
        self.step_log = StepLog(config, self.args, pd, options, self.global_batch_size, self.device, params, self.step)
        self.validator = build_validator(config, self.data, self.model, pd, self.device, self.tokenizer.pad_id,
                                         self.accumulation_steps)
        if self.rank == 0:
            print(startup_line(config, self.spec, self.weights, self.compute, options, pd, params,
                               self.global_batch_size, self.accumulation_steps, self.device, self.step, self.resumed,
                               dist.get_world_size() if self.fake else 0, record_note), flush=True)
            if self.step >= t.steps:
                print(f"all {t.steps} steps of training.steps are done ({self.weights.describe()}); nothing to "
                      f"train: raise training.steps to go on", flush=True)

    def _release_locks(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def train_step(self, data_iter) -> dict:
        """One optimizer step; returns its numbers. With ``training.sync_free_step`` nothing is read from
        the device unless the step logs, saves, validates or ends the run (:meth:`_reads_now`): the
        update is skipped on the device when non-finite (:class:`StepGuard`), and the host reads the
        guard one step late, before the next update. Without it the guard is read before the update."""
        pd = self.parallel_dims
        number = self.step + 1
        data = self.data_wait.next(data_iter)  # the wait for the step's data (StepData)
        step_loss = forward_backward(self.model, data.microbatches, pd.get_mesh("loss"))
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.training.max_norm)
        guard = StepGuard(step_loss, grad_norm, self._signalled, number, decide=not self.fake)
        if self.pending is not None:  # the last step, read now that this one's work is queued
            pending, self.pending = self.pending, None
            if self._settle(pending, pending.read()):
                self.lr_scheduler.step()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        lr = next((x for x in lrs if not math.isfinite(x)), lrs[0])
        if not self.fake and not math.isfinite(lr):  # the host's own number: stop before the update
            values = guard.read()
            self._nonfinite_step(values.objective(guard.aux_coef), values.grad_norm, lr)
        extra = self._log_counts(data.counts, step_loss) if self.step_log.due(number) else None
        if not self.sync_free:  # the old order: read, decide on the host, then update or not
            values = guard.read(extra)
            applied = self._settle(guard, values)
            if applied:
                self.optimizer.step()
        else:
            optimizer_step(self.optimizer, guard.found_inf)
            applied = None
        precompute_float8_scales(self.model, self.float8)
        self.optimizer.zero_grad(set_to_none=True)
        if self.sync_free:
            if not self._reads_now(number):
                self.pending = guard.to_host()
                return {"lr": lr}
            values = guard.read(extra)
            applied = self._settle(guard, values)
        if applied:
            self.lr_scheduler.step()
        return self._numbers(guard, values, applied, lr)

    def stepped(self, first: bool) -> None:
        """What follows every step of :meth:`train_step` (the loop here, ``benchmarks/profile_cell.py``): the
        count, and after the first step the slice checks stop (its slices passed; every later one has their
        shape) and the collectives take the training timeout (start-up and compilation are over)."""
        self.step += 1
        if first:
            if not self.fake:
                set_timeouts(self.config.comm.train_timeout_seconds, exclude=(self.checkpointer.group,))
            stop_slice_checks(self.model)

    def _reads_now(self, number: int) -> bool:
        """Whether step ``number``'s guard is read at its end: it logs, saves, validates or is the last,
        or a rank was signalled (it saves); else it is read one step late."""
        ck = self.checkpointer
        return (self.step_log.due(number) or number == self.config.training.steps or self.preempted
                or (ck.enable and number % ck.interval == 0)
                or (self.validator is not None and self.validator.due(number)))

    def _log_counts(self, counts: torch.Tensor, step_loss: StepLoss) -> torch.Tensor:
        """The step line's counts (:class:`LoggedCounts`' fields in order), reduced over dp on the device, to be
        read with the guard. ``counts`` came up with the step's microbatches (``data/microbatches.py``)."""
        # every sp rank of a dp group loaded the same rows: count them over dp only
        counts = dist_sum(counts, self.parallel_dims.get_mesh("dp"))
        experts = step_loss.expert_counts
        return torch.cat([counts, step_loss.tokens.double()[None]] + ([] if experts is None else [
            experts.max()[None] / experts.mean().clamp(min=1e-9)]))

    def _numbers(self, guard: StepGuard, values: GuardValues, applied: bool, lr: float) -> dict:
        out = {"loss": values.loss, "grad_norm": values.grad_norm, "lr": lr}
        if not applied:
            out["skipped"] = True
            return out
        if guard.has_aux:  # a mixture of experts: the objective was loss + aux_coef * aux_loss
            out["aux_loss"] = values.aux
        if values.logged:
            logged = LoggedCounts(*values.logged)
            if logged.expert_load is not None:  # the busiest expert's assignments over the mean (summed over layers)
                out["expert_load_max_over_mean"] = logged.expert_load
            out.update(loss_tokens=int(logged.loss_tokens), padding=logged.padding / max(logged.tokens, 1.0),
                       truncated=int(logged.truncated),
                       dropped=self.data.stats.get("dropped", 0))  # samples left out of the dataset (run total)
        return out

    def _settle(self, guard: StepGuard, values: GuardValues) -> bool:
        """Act on a step's read guard: note a signalled rank (every rank saves and stops after the
        same step: :attr:`preempted`), and count a non-finite step as skipped or stop
        (:meth:`_nonfinite_step`). Returns whether the update was applied (the schedule then advances)."""
        self.preempted = self.preempted or values.signalled
        if values.nonfinite:
            lr = self.optimizer.param_groups[0]["lr"]
            self._nonfinite_step(values.objective(guard.aux_coef), values.grad_norm, lr, guard.number)
            return False
        self.nonfinite_in_a_row = 0
        return True

    def _nonfinite_step(self, global_loss: float, grad_norm: float, lr: float, step: int | None = None) -> None:
        """Skip step ``step``'s update (``training.skip_nonfinite_steps`` in a row at most) or stop."""
        step = self.step + 1 if step is None else step
        if not math.isfinite(global_loss):
            what = f"loss is {global_loss} at step {step}"
        elif not math.isfinite(grad_norm):
            what = f"gradient norm is {grad_norm} at step {step} (loss {global_loss:.4f})"
        elif not math.isfinite(lr):
            what = f"learning rate is {lr} at step {step}"
        else:  # this rank's numbers are finite: the world's decision came from another rank's
            what = f"another rank's loss or gradient norm is NaN/inf at step {step} (loss {global_loss:.4f} here)"
        limit = self.config.training.skip_nonfinite_steps
        self.nonfinite_in_a_row += 1
        if math.isfinite(lr) and self.nonfinite_in_a_row <= limit:
            if self.rank == 0:
                print(f"{what}: update skipped (weights, optimizer and schedule unchanged), "
                      f"{self.nonfinite_in_a_row} of training.skip_nonfinite_steps {limit} in a row", flush=True)
            return
        newest = self.checkpointer.latest_step() if self.checkpointer.enable else None
        kept = ("checkpointing is off" if not self.checkpointer.enable else "no checkpoint has been saved yet"
                if newest is None else f"the newest checkpoint, step-{newest}, is kept")
        in_a_row = f" ({self.nonfinite_in_a_row} such steps in a row)" if limit else ""
        raise NonFiniteLossError(f"{what}{in_a_row}; stopping before the optimizer step, nothing saved; {kept}")

    def train(self) -> None:
        t = self.config.training
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        # Creating the iterator draws a base seed from the global generator that nothing uses
        # (no worker processes); undone, so that the generator a checkpoint saves is the same
        # in a resumed run as in an uninterrupted one.
        rng = torch.get_rng_state()
        data_iter = iter(self.dataloader)
        torch.set_rng_state(rng)
        first_step = True
        profiler = StepProfiler(self.config.profiling, self.config.job.dump_folder, self.rank, self.step, self.device.type)
        collector = StepGC(t.gc_freq)  # after start-up: its objects are frozen
        self.step_log.start()
        try:
            while self.step < t.steps:
                out = self.train_step(data_iter)
                lr = out.pop("lr")
                self.stepped(first_step)
                self.step_log.stepped(out.get("loss"))
                first_step = False
                profiler.step(self.step)
                collector.step(self.step)
                if self.step_log.due(self.step):
                    self.metrics.log(self.step_log.record(self.step, out, lr, self.data_wait.take(), self.model,
                                                          self.optimizer))
                if self.validator is not None and self.validator.due(self.step):
                    started = time.perf_counter()
                    result = self.validator.run()
                    self.metrics.log_validation(self.step, result)
                    self.step_log.progress.validation = (self.step, result["validation_loss"])
                    self.step_log.exclude(time.perf_counter() - started)  # evaluation time is not training throughput
                self.checkpointer.save(self.step, force=self.preempted or self.step == t.steps)
                if self.preempted:
                    if self.rank == 0:
                        print(f"preempted: saved step {self.step}, exiting", flush=True)
                    break
            self._summary()
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            limit = "comm.init_timeout_seconds" if first_step else "comm.train_timeout_seconds"
            raise RuntimeError(f"step {self.step + 1}: a collective waited longer than {limit} "
                               f"({getattr(self.config.comm, limit.split('.')[1])}s) for another rank: one stalled or "
                               f"died (see its log); the newest checkpoint is the one to resume from") from e
        finally:
            profiler.close()
            collector.close()
            self.dataloader.close()  # the prefetch thread stops, at the end and on an error
            self.checkpointer.close()
            self.metrics.close()
            self._release_locks()

    def _summary(self) -> None:
        if self.rank != 0:
            return
        # the last step is always saved (an async save completes at close)
        checkpoint = os.path.join(self.checkpointer.folder, f"step-{self.step}") if self.checkpointer.enable else None
        self.metrics.log_summary(self.step_log.progress.summary(
            self.step, checkpoint, os.path.join(self.config.job.dump_folder, "metrics.jsonl")))
