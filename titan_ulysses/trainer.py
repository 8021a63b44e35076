"""The training loop: build (checks, mesh, data, model, optimizer, checkpoint) -> loop (step, log,
evaluate, checkpoint). Each part is built by its package's builder; this file only orders them."""

from __future__ import annotations

import math
import os
import signal
import time

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.build import build_checkpointer, load_weights, lock_run_folders
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
from titan_ulysses.distributed.utils import clip_grad_norm_, dist_sum, forward_backward
from titan_ulysses.distributed.watchdog import set_timeouts
from titan_ulysses.heldout import build_validator
from titan_ulysses.metrics.logger import build_metrics_logger
from titan_ulysses.metrics.startup import startup_line
from titan_ulysses.metrics.step_log import StepLog
from titan_ulysses.metrics.system import WaitTimer
from titan_ulysses.models.build import build_parallel_model
from titan_ulysses.optim import build_optimizers, follow_config
from titan_ulysses.preflight import check_device, check_launch


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or the learning rate of a step is NaN/inf: the run stops
    before the optimizer touches the weights."""


class Trainer:
    """``Trainer(config)`` builds the run (collective: every rank constructs it); ``train()`` runs it."""

    def __init__(self, config: JobConfig):
        self.config = config
        t = config.training
        # checks: everything that can refuse the run, before any process group
        self.parallel_dims, self.spec, record_note = check_launch(config)
        pd = self.parallel_dims
        self.fake = config.comm.mode == "fake"
        # mesh
        self.device = join_job(config)
        check_device(config, pd, self.device, self.spec.args)
        build_mesh(config, pd, self.device)
        self.rank = dist.get_rank()
        self.locks = lock_run_folders(config, self.rank)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)
        # data
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
        # model
        self.args = self.spec.args
        self.model, self.compute, options = build_parallel_model(config, self.args, pd, self.device)
        self.float8 = options.float8
        self.trainable_params, self.total_params = parameter_counts(self.model)
        # optimizer
        self.optimizer, self.lr_scheduler = build_optimizers(config, self.model, self.device)
        # checkpoint, and the weights the run starts from
        self.checkpointer = build_checkpointer(config, self.model, self.optimizer, self.lr_scheduler,
                                               self.dataloader, self.args, options.lora)
        self.weights = load_weights(config, self.checkpointer, self.model, self.args, self.device,
                                    lora=options.lora is not None)
        self.step = self.weights.step
        resumed = ""
        if self.step > 0:  # the config wins over the restored optimizer and schedule
            try:  # a changed model setting is refused unless checkpoint.override_recorded lists it
                changes = resume_changes(self.checkpointer.loaded_settings, resume_settings(config), overrides(config))
            except ConfigError:
                self.checkpointer.close()
                self._release_locks()
                raise
            follow_config(self.optimizer, self.lr_scheduler, config)
            resumed = f"; resumed: {changes}"
        self.resumed = resumed  # what the resume changed, as the start-up line says it
        # logging and evaluation
        self.nonfinite_in_a_row = 0
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
                               self.global_batch_size, self.accumulation_steps, self.device, self.step, resumed,
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
        """One optimizer step; returns its numbers. The device is read once (:meth:`_read_guard`);
        when the step's line is due, the step's token counts are reduced and read too."""
        pd = self.parallel_dims
        microbatches, counts = self.data_wait.next(data_iter)  # the wait for the step's data
        step = forward_backward(self.model, microbatches, pd.get_mesh("loss"))
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.training.max_norm)
        global_loss, grad_norm, aux = self._read_guard(step, grad_norm)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        lr = next((x for x in lrs if not math.isfinite(x)), lrs[0])
        objective = global_loss + (step.aux_coef * aux if step.aux_coef else 0.0)
        if not self.fake and not all(map(math.isfinite, (objective, grad_norm, lr))):
            # every rank sees the same reduced loss, norm and lr: all skip or all stop
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite_step(objective, grad_norm, lr)
            return {"loss": global_loss, "grad_norm": grad_norm, "skipped": True}
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        precompute_float8_scales(self.model, self.float8)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out = {"loss": global_loss, "grad_norm": grad_norm}
        if step.aux is not None:  # a mixture of experts: the objective was loss + aux_coef * aux_loss
            out["aux_loss"] = aux
        if self.step_log.due(self.step + 1):
            # every sp rank of a dp group loaded the same rows: count them over dp only
            counts = dist_sum(counts.to(self.device), pd.get_mesh("dp"))
            read = torch.cat([counts, step.tokens.double()[None]] + ([] if step.expert_counts is None else [
                step.expert_counts.max()[None] / step.expert_counts.mean().clamp(min=1e-9)]))
            pad, total_tokens, truncated, loss_tokens, *load = read.tolist()
            if load:  # the busiest expert's assignments over the mean (summed over layers): 1 is balanced
                out["expert_load_max_over_mean"] = load[0]
            out.update(loss_tokens=int(loss_tokens), padding=pad / max(total_tokens, 1.0), truncated=int(truncated),
                       dropped=self.data.stats.get("dropped", 0))  # samples left out of the dataset (run total)
        return out

    def _read_guard(self, step, grad_norm: torch.Tensor) -> tuple[float, float, float]:
        """The one read of the device every step needs: the reduced loss (and a mixture of experts'
        load-balancing loss, 0 without) and gradient norm, which
        decide before the optimizer step whether it may touch the weights (``_nonfinite_step``),
        read together with whether any rank was signalled (a MAX over the world, so that every
        rank saves and stops after the same step: :attr:`preempted`)."""
        flag = torch.full((), 1.0 if self._signalled else 0.0, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        aux = torch.zeros((), device=self.device) if step.aux is None else step.aux.float()
        loss, aux, grad_norm, flag = torch.stack([step.loss.float(), aux, grad_norm.float().to(self.device),
                                                  flag]).tolist()
        self.preempted = flag > 0
        return loss, grad_norm, aux

    def _nonfinite_step(self, global_loss: float, grad_norm: float, lr: float) -> None:
        """Skip this step's update (``training.skip_nonfinite_steps`` in a row at most) or stop."""
        step = self.step + 1
        if not math.isfinite(global_loss):
            what = f"loss is {global_loss} at step {step}"
        elif not math.isfinite(grad_norm):
            what = f"gradient norm is {grad_norm} at step {step} (loss {global_loss:.4f})"
        else:
            what = f"learning rate is {lr} at step {step}"
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
        self.step_log.start()
        try:
            while self.step < t.steps:
                lr = self.lr_scheduler.get_last_lr()[0]
                out = self.train_step(data_iter)
                self.step += 1
                self.step_log.stepped(out["loss"])
                if first_step:
                    if not self.fake:  # start-up and compilation are over
                        set_timeouts(self.config.comm.train_timeout_seconds, exclude=(self.checkpointer.group,))
                    stop_slice_checks(self.model)  # the first step's slices passed; every later one has their shape
                first_step = False
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
