"""The training loop: config -> process group -> mesh -> model -> parallelize -> step -> log -> checkpoint."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from titan_ulysses.checkpoint.folders import output_folder_problem
from titan_ulysses.checkpoint.hf_export import write_model_record
from titan_ulysses.checkpoint.lora_export import write_lora_record
from titan_ulysses.checkpoint.lock import FolderInUseError, RunLock
from titan_ulysses.checkpoint.manager import CheckpointManager
from titan_ulysses.checkpoint.weight_source import adopt_start_record, load_start_weights
from titan_ulysses.config.job_config import JobConfig
from titan_ulysses.config.manager import ConfigError, resolved_global_batch_size
from titan_ulysses.config.resume import resume_settings, settings_changes
from titan_ulysses.data.build import build_data, check_dataset_files
from titan_ulysses.data.sharding import shard_loader_batch
from titan_ulysses.data.tokenizer import resolve_tokenizer
from titan_ulysses.distributed.float8 import float8_options, precompute_float8_scales
from titan_ulysses.distributed.heads import uneven_note
from titan_ulysses.distributed.lora import init_lora, lora_options, parameter_counts
from titan_ulysses.distributed.parallel_dims import ParallelDims
from titan_ulysses.distributed.utils import clip_grad_norm_, dist_sum, forward_backward, load_full_state_dict
from titan_ulysses.distributed.watchdog import exit_with_launcher, set_timeouts
from titan_ulysses.metrics.comm import context_parallel_bytes_per_step, ulysses_bytes_per_step
from titan_ulysses.metrics.flops import flops_per_token, peak_flops
from titan_ulysses.metrics.logger import MetricsLogger, max_memory_gib
from titan_ulysses.metrics.loggers.wandb_logger import WandbError
from titan_ulysses.metrics.progress import RunProgress
from titan_ulysses.metrics.system import WaitTimer, system_metrics
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.hf_config import describe
from titan_ulysses.models.llama.args import LlamaArgs
from titan_ulysses.models.llama.parallelize import ParallelizeOptions
from titan_ulysses.models.registry import build_model, parallelize_model
from titan_ulysses.models.resolve import model_args
from titan_ulysses.ops.attention import check_attention_settings, sdpa_priority
from titan_ulysses.optim import apply_hyperparameters, build_lr_scheduler, build_optimizer
from titan_ulysses.preflight import check_files, validate
from titan_ulysses.heldout import build_validator

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or the learning rate of a step is NaN/inf: the run stops
    before the optimizer touches the weights."""


def init_distributed(fake_world_size: int = 0, timeout_seconds: float | None = None) -> torch.device:
    """Join the torchrun job (or run as a world of one); NCCL on CUDA, gloo on CPU.

    With ``fake_world_size`` > 0, become rank 0 of that many ranks on PyTorch's fake
    process group (collectives return at once and move no data). ``timeout_seconds``
    bounds the rendezvous and every collective until ``set_timeouts`` changes it.
    """
    timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if fake_world_size and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world_size)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:  # plain `python train.py`
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", RANK="0", WORLD_SIZE="1")
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout)
    return device


def init_weights(model: torch.nn.Module, args: LlamaArgs, device: torch.device, seed: int, lora: bool = False) -> None:
    """Initialise the sharded model so that its weights do not depend on the layout.

    On CUDA, DTensor's offset-based RNG makes sharded init equal to unsharded init. On CPU
    there is no such tracker (every shard would draw the same numbers), so the full model
    is initialised on the host and loaded; CPU runs use small models.
    """
    if device.type == "cpu":
        model.init_buffers(device)
        full = build_model(args)
        torch.manual_seed(seed)
        full.init_weights()
        load_full_state_dict(model, full.state_dict(), strict=not lora)  # LoRA adapters: init_lora
    else:
        torch.manual_seed(seed)
        model.init_weights(buffer_device=device)


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        record_note = adopt_start_record(config)  # before validation: it may give the architecture
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        check_dataset_files(config)  # before the layout: a layout error must not hide a missing file
        self.parallel_dims: ParallelDims = validate(config, world_size)  # before any process group work
        check_files(config)
        problem = output_folder_problem("job.dump_folder", config.job.dump_folder)
        if problem:
            raise ConfigError(problem)
        self.fake = config.comm.mode == "fake"
        exit_with_launcher()
        self.device = init_distributed(config.comm.fake_world_size if self.fake else 0, config.comm.init_timeout_seconds)
        try:  # what the attention backend cannot do on this device (ops/attention/registry.py)
            check_attention_settings(config.model.attn_backend, config.model.sdpa_backends, self.parallel_dims.cp,
                                     self.device.type)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        self.rank = dist.get_rank()
        if self.device.type == "cuda" and self.rank == 0:
            from titan_ulysses.metrics.memory_fit import memory_warning

            total = torch.cuda.get_device_properties(self.device).total_memory
            warning = memory_warning(config, self.parallel_dims, dist.get_world_size(), total)
            if warning:
                print(f"warning: {warning}", file=sys.stderr, flush=True)
        pd = self.parallel_dims
        pd.build_mesh(self.device.type)
        if not self.fake:
            set_timeouts(config.comm.init_timeout_seconds)  # the mesh's groups took gloo's 30-minute default
        self.lock = self._lock_dump_folder()
        self.checkpoint_lock = self._lock_checkpoint_folder()
        t = config.training
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(t.seed)

        dp_mesh = pd.get_mesh("dp")
        self.global_batch_size = resolved_global_batch_size(config, pd.size("dp"))
        self.accumulation_steps = self.global_batch_size // (t.local_batch_size * pd.size("dp"))
        self.tokenizer = resolve_tokenizer(config.model)
        self.data = build_data(config, self.tokenizer, dp_mesh.get_local_rank(), dp_mesh.size(),
                               self.global_batch_size, fake=self.fake)
        self.dataloader = self.data.dataloader

        self.args = model_args(config, self.tokenizer.vocab_size)
        self.compute = ComputeOptions.from_config(config.model)  # how it computes (not in the checkpoint)
        with torch.device("meta"):
            model = build_model(self.args, self.compute)
        options = ParallelizeOptions(
            ac_mode=config.activation_checkpoint.mode,
            ac_layers_per_checkpoint=config.activation_checkpoint.layers_per_checkpoint,
            compile=config.compile.enable,
            param_dtype=DTYPES[t.mixed_precision_param],
            reduce_dtype=DTYPES[t.mixed_precision_reduce],
            cpu_offload=t.enable_cpu_offload,
            float8=float8_options(config),
            lora=lora_options(config.lora),
            ulysses_head_stages=config.parallelism.ulysses_head_stages,
            ulysses_stage_keep_attention=config.parallelism.ulysses_stage_keep_attention,
        )
        self.float8 = options.float8
        self.model = parallelize_model(model, pd, options)
        self.model.rope_seq_len = t.seq_len  # the full length each rank's slice belongs to (longrope)
        self.model.to_empty(device=self.device)
        c = config.checkpoint
        ckpt_folder = os.path.join(config.job.dump_folder, c.folder)
        self.model.init_buffers(self.device)  # the weights come from load_start_weights below
        self.trainable_params, self.total_params = parameter_counts(self.model)

        o = config.optimizer
        # with CPU offload the optimizer steps on host-resident shards
        opt_device = "cpu" if t.enable_cpu_offload else self.device.type
        self.optimizer = build_optimizer(self.model, o.name, o.lr, o.weight_decay, o.eps, (o.beta1, o.beta2), opt_device)
        s = config.lr_scheduler
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, t.steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor
        )
        self.checkpointer = CheckpointManager(
            folder=ckpt_folder, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, enable=c.enable, interval=c.interval,
            async_mode=c.async_mode, keep_latest_k=c.keep_latest_k, settings=resume_settings(config),
            timeout_seconds=config.comm.init_timeout_seconds,
            extras=lambda d: (write_model_record(d, self.args, config.model.hf_assets_path, t.seq_len),
                              write_lora_record(d, options.lora, config.model.hf_assets_path or config.model.flavor)),
        )
        # one decision: this run's newest good checkpoint, initial_load_path, the HF folder, random init
        lora = options.lora is not None
        self.weights = load_start_weights(
            config, self.checkpointer, self.model,
            lambda: init_weights(self.model, self.args, self.device, t.seed, lora=lora),
            # adapters start as peft's (B = 0); a checkpoint replaces them
            init_adapters=(lambda: init_lora(self.model, t.seed)) if lora else None,
        )
        self.step = self.weights.step
        resumed = ""
        if self.step > 0:  # the config wins over the restored optimizer and schedule
            apply_hyperparameters(self.optimizer, self.lr_scheduler, o.lr, o.weight_decay, o.eps, (o.beta1, o.beta2))
            resumed = f"; resumed: {settings_changes(self.checkpointer.loaded_settings, resume_settings(config))}"
        self.nonfinite_in_a_row = 0
        self.metrics = self._build_metrics_logger()
        self.data_wait = WaitTimer()
        self.flops_per_token = flops_per_token(self.args, t.seq_len,
                                               self.trainable_params if options.lora is not None else 0)
        self.peak_flops = peak_flops(self.device)
        # packed rows hold several documents: every backend masks per document (ops/attention/registry.py)
        self.use_doc_mask = self.data.packed
        self.validator = build_validator(config, self.data, self.model, pd, self.device, self.tokenizer.pad_id,
                                         self.accumulation_steps)
        comm_args = (torch.finfo(options.param_dtype).bits // 8, options.ac_mode in ("full", "full_offload"))
        self.a2a_bytes = ulysses_bytes_per_step(
            self.args, t.seq_len, self.global_batch_size // pd.size("dp"), pd.sp, pd.tp, *comm_args, cp=pd.cp,
        )
        self.cp_bytes = context_parallel_bytes_per_step(
            self.args, t.seq_len, self.global_batch_size // pd.size("dp"), pd.cp, pd.sp, pd.tp, *comm_args,
        )
        self._preempted = False
        if self.rank == 0:
            source = f"flavor {config.model.flavor}"
            if config.model.hf_assets_path:
                source = f"{describe(self.args)} (from {config.model.hf_assets_path}/config.json)"
            source += f", weights from {self.weights.describe()}"
            attention = self.compute.attn_backend
            if attention == "sdpa":  # which kernel runs first (model.sdpa_backends)
                order = sdpa_priority(self.compute.sdpa_backends)
                attention += f" ({' > '.join(order)})" if order else " (PyTorch's kernel order)"
            print(
                f"titan-ulysses: {self.args.num_params() / 1e6:.1f}M params, {source}, "
                + (f"LoRA rank {options.lora.rank} on {','.join(options.lora.targets)}: "
                   f"{self.trainable_params / 1e6:.3f}M trainable of {self.total_params / 1e6:.1f}M, "
                   if options.lora is not None else "")
                + f"layout {pd.degrees}, global batch {self.global_batch_size} x {t.seq_len} tokens "
                f"({self.accumulation_steps} microbatch(es)), device {self.device.type}, attention {attention}, "
                f"starting at step {self.step}"
                + resumed
                + (f"\nFAKE process group: rank 0 of {dist.get_world_size()}; memory and compute are real, "
                   f"losses are not" if self.fake else "")
                + "".join(f"\nnote: {n}" for n in [uneven_note(self.args.n_heads, self.args.n_kv_heads, pd.sp, pd.tp),
                                                     record_note] if n),
                flush=True,
            )
            if self.step >= t.steps:
                print(f"all {t.steps} steps of training.steps are done ({self.weights.describe()}); nothing to "
                      f"train: raise training.steps to go on", flush=True)

    def _lock_checkpoint_folder(self) -> RunLock | None:
        """A checkpoint.folder outside the dump folder (an absolute path) gets a lock of its own:
        two dump folders naming the same one must not resume and save into it together."""
        c, dump = self.config.checkpoint, self.config.job.dump_folder
        folder = os.path.join(dump, c.folder)
        real, dump_real = os.path.realpath(folder), os.path.realpath(dump)
        inside = real == dump_real or real.startswith(dump_real + os.sep)  # the dump folder's lock covers it
        if not c.enable or inside:
            return None
        return self._lock_dump_folder(folder, "checkpoint.folder")

    def _lock_dump_folder(self, folder: str = "", setting: str = "job.dump_folder") -> RunLock | None:
        """Rank 0 takes the dump folder's lock for the life of the run; a refusal reaches every rank."""
        lock, error = None, None
        if self.rank == 0:
            lock = RunLock(folder or self.config.job.dump_folder, setting)
            try:
                note = lock.acquire()
                if note:
                    print(f"warning: {note}", file=sys.stderr, flush=True)
            except FolderInUseError as e:
                lock, error = None, str(e)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise FolderInUseError(box[0])
        return lock

    def _build_metrics_logger(self) -> MetricsLogger:
        """Rank 0's loggers; a W&B start-up failure (no login) reaches every rank as a config error."""
        logger, error = None, None
        try:
            logger = MetricsLogger(self.config.job.dump_folder, self.rank, self.config.metrics,
                                   dataclasses.asdict(self.config), resumed=self.step > 0)
        except WandbError as e:
            error = str(e)
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            if self.lock is not None:
                self.lock.release()  # the run never starts
            raise ConfigError(box[0])
        return logger

    def _on_preempt(self, signum, frame) -> None:
        self._preempted = True

    def _microbatches(self, data_iter, stats: torch.Tensor):
        """This rank's microbatches of one step; ``stats`` += [padding tokens, tokens, truncated samples]."""
        sp_mesh, cp_mesh = self.parallel_dims.get_mesh("sp"), self.parallel_dims.get_mesh("cp")
        for _ in range(self.accumulation_steps):
            batch = self.data_wait.next(data_iter)
            stats += torch.tensor([float((batch["document_ids"] == -1).sum()), float(batch["input"].numel()),
                                   float(batch["truncated"].sum()) if "truncated" in batch else 0.0])
            yield shard_loader_batch(batch, sp_mesh.get_local_rank(), sp_mesh.size(), self.device,
                                     self.use_doc_mask, self.tokenizer.pad_id, cp_mesh.get_local_rank(), cp_mesh.size())

    def train_step(self, data_iter) -> dict:
        pd = self.parallel_dims
        stats = torch.zeros(3, dtype=torch.float64)
        microbatches = list(self._microbatches(data_iter, stats))
        global_loss, n_tokens = forward_backward(self.model, microbatches, pd.get_mesh("loss"))
        global_loss = global_loss.item()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.training.max_norm).item()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        lr = next((x for x in lrs if not math.isfinite(x)), lrs[0])
        if not self.fake and not all(map(math.isfinite, (global_loss, grad_norm, lr))):
            # every rank sees the same reduced loss, norm and lr: all skip or all stop
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite_step(global_loss, grad_norm, lr)
            return {"loss": global_loss, "grad_norm": grad_norm, "skipped": True}
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        precompute_float8_scales(self.model, self.float8)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # every sp rank of a dp group loaded the same rows: count them over dp only
        pad, total_tokens, truncated = dist_sum(stats.to(self.device), pd.get_mesh("dp")).tolist()
        return {"loss": global_loss, "grad_norm": grad_norm, "loss_tokens": int(n_tokens.item()),
                "padding": pad / max(total_tokens, 1.0), "truncated": int(truncated),
                "dropped": self.data.stats.get("dropped", 0)}  # samples left out of the dataset (run total)

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
            signal.signal(sig, self._on_preempt)
        # Creating the iterator draws a base seed from the global generator that nothing uses
        # (no worker processes); undone, so that the generator a checkpoint saves is the same
        # in a resumed run as in an uninterrupted one.
        rng = torch.get_rng_state()
        data_iter = iter(self.dataloader)
        torch.set_rng_state(rng)
        tokens_per_step = self.global_batch_size * t.seq_len
        world = dist.get_world_size()
        timer, steps_timed = time.perf_counter(), 0
        first_step = True
        progress = RunProgress(self.step, t.steps, tokens_per_step)
        try:
            while self.step < t.steps:
                lr = self.lr_scheduler.get_last_lr()[0]
                out = self.train_step(data_iter)
                self.step += 1
                progress.last_loss = out["loss"]
                steps_timed += 1
                if first_step and not self.fake:  # start-up and compilation are over
                    set_timeouts(self.config.comm.train_timeout_seconds, exclude=(self.checkpointer.group,))
                first_step = False
                if self.step % self.config.metrics.log_freq == 0 or self.step == 1 or self.step == t.steps:
                    elapsed = time.perf_counter() - timer
                    tps = tokens_per_step * steps_timed / elapsed / world
                    mfu = None if self.peak_flops is None else 100 * tps * self.flops_per_token / self.peak_flops
                    self.metrics.log({
                        "step": self.step, **out, "lr": lr, "tokens_per_sec_per_device": tps,
                        "mfu": mfu, "max_memory_gib": max_memory_gib(self.device),
                        "trainable_params": self.trainable_params, "params": self.total_params,
                        "a2a_gib_per_step": self.a2a_bytes / 2**30,
                        "a2a_model_sec": self.a2a_bytes / (self.config.comm.link_bandwidth_gbps * 1e9),
                        **({"cp_gib_per_step": self.cp_bytes / 2**30} if self.cp_bytes else {}),
                        "data_wait_sec": self.data_wait.take() / steps_timed,  # rank 0's, per step
                        **system_metrics(self.device, self.model, self.optimizer),
                        **progress.timing(self.step),
                    })
                    timer, steps_timed = time.perf_counter(), 0
                if self.validator is not None and self.validator.due(self.step):
                    started = time.perf_counter()
                    result = self.validator.run()
                    self.metrics.log_validation(self.step, result)
                    progress.validation = (self.step, result["validation_loss"])
                    timer += time.perf_counter() - started  # evaluation time is not training throughput
                preempted = self._preempted_anywhere()
                self.checkpointer.save(self.step, force=preempted or self.step == t.steps)
                if preempted:
                    if self.rank == 0:
                        print(f"preempted: saved step {self.step}, exiting", flush=True)
                    break
            self._summary(progress)
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            limit = "comm.init_timeout_seconds" if first_step else "comm.train_timeout_seconds"
            raise RuntimeError(f"step {self.step + 1}: a collective waited longer than {limit} "
                               f"({getattr(self.config.comm, limit.split('.')[1])}s) for another rank: one stalled or "
                               f"died (see its log); the newest checkpoint is the one to resume from") from e
        finally:
            self.checkpointer.close()
            self.metrics.close()
            for lock in (self.checkpoint_lock, self.lock):
                if lock is not None:
                    lock.release()

    def _summary(self, progress: RunProgress) -> None:
        if self.rank != 0:
            return
        # the last step is always saved (an async save completes at close)
        checkpoint = os.path.join(self.checkpointer.folder, f"step-{self.step}") if self.checkpointer.enable else None
        self.metrics.log_summary(progress.summary(
            self.step, checkpoint, os.path.join(self.config.job.dump_folder, "metrics.jsonl")))

    def _preempted_anywhere(self) -> bool:
        """A signal may reach only some ranks: agree on it so that all of them save together."""
        flag = torch.tensor([1.0 if self._preempted else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
