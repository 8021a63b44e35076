"""transformers' Trainer and TRL's SFT and DPO trainers at sp=N: one call on a trainer built as usual.

    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, ...)
    trainer = ulysses_trainer(trainer, sp=2)  # before trainer.train()
    trainer.train()

What it changes, and nothing else (no second trainer, exchange or loss):
- the model (and DPO's reference model) goes under :func:`apply_ulysses` over a ``(dp, sp)``
  mesh of every process, before accelerate wraps it (DDP, or FSDP2 over every rank, asked for
  in the TrainingArguments or by ``accelerate launch``'s config; on CPU too);
- accelerate's data loader shards by the dp rank only (its own ``BatchSamplerShard``, with the
  dp degree and rank): every rank of an sp group gets the same rows, in the same order;
- ``compute_loss`` cuts the rows with :func:`shard_batch` and sums this rank's token losses.
  Training divides by the label tokens of the whole optimizer step (every dp rank, every sp
  slice, every gradient-accumulation micro-batch: ``num_items_in_batch``, counted on the full
  rows and summed over dp), never by a per-rank or per-micro-batch count;
- DPO: each row's log-probability is summed over the whole sequence across the sp ranks
  (a differentiable all-gather of the per-token scores) before the DPO loss (``dpo.py``).
Logging and evaluation then see one process's values (SFT: TRL's fused LM head and its token metrics, ``sft.py``);
``save_model`` writes the model with the kernel it was loaded with. Trainers the path cannot
serve exactly (GRPO and the other generation or reward trainers, ``compute_metrics``, iterable
datasets) are refused in one line.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_ulysses.ops.loss import IGNORE_INDEX

from .attention import apply_ulysses, option_refusal
from .batch import shard_batch, shifted_labels, sp_loss

__all__ = ["ulysses_trainer"]

SUPPORTED_TRL = ("SFTTrainer", "DPOTrainer")
"""TRL trainers whose loss this path makes exact; any other TRL trainer class in the MRO is refused."""
_BATCH_KEYS = {"input_ids", "labels", "shift_labels", "attention_mask", "position_ids", "cu_seq_lens_q",
               "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "use_cache", "num_items_in_batch"}
"""Keys of a batch compute_loss understands: the rows, their labels, and packing metadata of the full rows (the
full positions carry the same documents)."""


def _trl_refusal(trainer) -> str | None:
    for cls in type(trainer).__mro__:
        if cls.__module__.startswith("trl.") and cls.__name__.endswith("Trainer") and cls.__name__ != "BaseTrainer":
            if cls.__name__ not in SUPPORTED_TRL:
                return (f"ulysses_trainer: {cls.__name__} is not supported (its loss needs generation, rewards or "
                        f"per-sequence statistics this path does not split); supported: Trainer, "
                        f"{', '.join(SUPPORTED_TRL)}")
            if cls.__name__ == "SFTTrainer" and getattr(trainer.args, "loss_type", "nll") != "nll":
                return f"ulysses_trainer: SFTConfig.loss_type={trainer.args.loss_type!r}; only 'nll' is split exactly"
            return None
    return None


def _parallelism_refusal(trainer, sp: int) -> str | None:
    """accelerate's ParallelismConfig (the TrainingArguments' or the launcher's) may only shard over every rank."""
    accelerator = getattr(trainer, "accelerator", None)
    config = getattr(accelerator, "parallelism_config", None) or getattr(trainer.args, "parallelism_config", None)
    if config is None:
        return None
    other = [f"{k}={getattr(config, k)}" for k in ("sp_size", "cp_size", "tp_size", "dp_replicate_size")
             if (getattr(config, k, None) or 1) > 1]
    if not other:
        return None
    return (f"ulysses_trainer: accelerate's ParallelismConfig has {', '.join(other)}, which contradicts sp={sp} over a "
            f"(dp, sp) mesh with FSDP2 over every rank (sp_size is DeepSpeed's Ulysses, cp_size / tp_size split the "
            f"sequence or weights again, dp_replicate_size is HSDP, untested here); leave them at 1")


def _check(trainer, sp: int, options: dict) -> None:
    reason = (option_refusal("ulysses_trainer", **options) or _trl_refusal(trainer)
              or _parallelism_refusal(trainer, sp))
    if reason is None and trainer.compute_metrics is not None:
        reason = ("ulysses_trainer: compute_metrics needs every rank's full logits; evaluate the loss only "
                  "(compute_metrics=None) or evaluate without sp")
    if reason is None and getattr(trainer.args, "use_liger_kernel", False):
        reason = "ulysses_trainer: use_liger_kernel replaces the loss this path splits; set it to False"
    if reason is None and trainer.compute_loss_func is not None:
        reason = "ulysses_trainer: compute_loss_func is not split over sp; leave it unset"
    if reason is None and _asked_fsdp_version(trainer) not in (None, 2):
        reason = ("ulysses_trainer: FSDP1 (fsdp_config version 1) is not supported; set fsdp_config={'version': 2} "
                  "(accelerate launch's config: fsdp_version: 2)")
    if reason is None and (not dist.is_initialized() or dist.get_world_size() % sp or sp < 2):
        world = dist.get_world_size() if dist.is_initialized() else 1
        reason = (f"ulysses_trainer: sp={sp} needs 2 or more processes dividing the world ({world}); launch with "
                  f"torchrun --nproc-per-node N (N a multiple of sp)")
    if reason:
        raise ValueError(reason)


def _asked_fsdp_version(trainer) -> int | None:
    """The FSDP version the run asks for (None: no FSDP): accelerate's state, the TrainingArguments (``fsdp=``), or
    ``accelerate launch``'s config (its ``ACCELERATE_USE_FSDP`` / ``FSDP_VERSION`` environment), in that order."""
    accelerator = getattr(trainer, "accelerator", None)
    plugin = getattr(accelerator.state, "fsdp_plugin", None) if accelerator is not None else None
    if plugin is not None:
        return plugin.fsdp_version
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    if plugin_args is not None:
        return plugin_args.get("fsdp_version", 1)
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def _fsdp2_on_cpu(trainer) -> None:
    """FSDP2 as the run asks (``fsdp=True`` in the TrainingArguments, or ``accelerate launch`` with an FSDP2 config),
    on CPU too.

    accelerate 1.15 switches its state to FSDP only for GPU-like device types: on CPU (MULTI_CPU)
    it drops the plugin (transformers' from the TrainingArguments, or its own from the launcher's
    environment), and the Trainer would silently train under DDP. Here the state takes that plugin,
    built as they build it, so ``accelerator.prepare`` runs accelerate's own FSDP2 path.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU or getattr(state, "fsdp_plugin", None) is not None:
        return
    if _asked_fsdp_version(trainer) is None:
        return
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    # the Trainer's plugin, else accelerate's own from the launcher's FSDP_* environment (as Accelerator builds it)
    plugin = FullyShardedDataParallelPlugin(**(plugin_args or {}))
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does on GPU
    trainer.is_fsdp_enabled = True


def _reshard(loader, dp: int, dp_rank: int):
    """Make accelerate's prepared loader shard by the dp rank only: the same rows on every rank of an sp group.

    At dp=1 it yields one process's batches: accelerate's ``even_batches`` would complete a short last
    batch with rows from the start of the epoch, to even out processes that do not exist here."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if type(batch_sampler).__name__ == "BatchSamplerShard" and not batch_sampler.split_batches:
        batch_sampler.num_processes, batch_sampler.process_index = dp, dp_rank
        if dp == 1:
            batch_sampler.even_batches = False
        return loader
    raise ValueError(f"ulysses_trainer: the data loader is {type(loader).__name__} over "
                     f"{type(getattr(loader, 'dataset', None)).__name__}; only map-style datasets (datasets.Dataset, "
                     f"a list) without split_batches or dispatch_batches can be sharded by dp rank")


class UlyssesTrainerMixin:
    """The Trainer methods ``ulysses_trainer`` replaces (mixed in front of the trainer's own class)."""

    ulysses_mesh: DeviceMesh

    def _get_dataloader(self, *args, **kwargs):
        mesh = self.ulysses_mesh
        return _reshard(super()._get_dataloader(*args, **kwargs), mesh["dp"].size(), mesh["dp"].get_local_rank())

    def _get_num_items_in_batch(self, batch_samples, device):
        """The label tokens of the whole optimizer step: every micro-batch's full rows, summed over the dp ranks."""
        count = sum((shifted_labels(b) != IGNORE_INDEX).sum() for b in batch_samples)
        count = torch.as_tensor(count, device=device)
        if self.ulysses_mesh["dp"].size() > 1:
            dist.all_reduce(count, group=self.ulysses_mesh["dp"].get_group())
        return count

    def _ulysses_slice(self, inputs: dict) -> dict:
        """This rank's slice of ``inputs``' full rows (``shard_batch``), after refusing keys it cannot split."""
        unknown = sorted(k for k, v in inputs.items() if k not in _BATCH_KEYS and v is not None)
        if unknown:
            raise ValueError(f"ulysses_trainer: the batch holds {unknown}, which this path does not split over sp; "
                             f"drop them from the collator's output")
        return shard_batch(inputs, self.ulysses_mesh)

    def _ulysses_forward(self, model, inputs: dict):
        """(outputs, this rank's summed token loss, shift_labels) of this rank's slice of ``inputs``' full rows."""
        local = self._ulysses_slice(inputs)
        ids, labels = local["input_ids"], local["shift_labels"]  # [B, S/sp]
        if not self.ulysses_loss_chunk:
            outputs = model(input_ids=ids, position_ids=local["position_ids"], use_cache=False)
            summed = F.cross_entropy(outputs.logits.flatten(0, 1).float(), labels.flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum")
            return outputs, summed, labels
        # apply_ulysses(fused_loss=True): the model's forward scores its head chunk by chunk, no [B, S/sp, V] logits;
        # num_items_in_batch=1: transformers' convention (the sum over it) gives the summed loss
        outputs = model(input_ids=ids, position_ids=local["position_ids"], use_cache=False, shift_labels=labels,
                        num_items_in_batch=1)
        return outputs, outputs.loss, labels

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs, summed, labels = self._ulysses_forward(model, inputs)
        # evaluation (transformers passes num_items_in_batch there too, summed over dp here): this dp rank's batch token
        # mean on every sp rank, as one process's per-batch loss; the Trainer averages the batches as one process does
        if num_items_in_batch is None or not model.training:
            count = (labels != IGNORE_INDEX).sum()
            loss = sp_loss(summed / count.clamp(min=1), labels, self.ulysses_mesh["sp"])
        else:  # training: this rank's share of the step's token mean; DDP / FSDP average over every rank
            loss = summed * self.ulysses_mesh.size() / num_items_in_batch.clamp(min=1)
        return (loss, outputs) if return_outputs else loss

    def _save(self, output_dir=None, state_dict=None):
        """Write the model with the kernel it was loaded with, not the Ulysses function's registered name."""
        config = self.accelerator.unwrap_model(self.model).config
        name, config._attn_implementation = config._attn_implementation, self.ulysses_kernel
        try:
            return super()._save(output_dir, state_dict=state_dict)
        finally:
            config._attn_implementation = name


def ulysses_trainer(trainer, sp: int, loss_chunk_size: int = 0, mlp_tile_size: int = 0, head_stages: int = 1):
    """Switch ``trainer`` (transformers' Trainer, TRL's SFTTrainer or DPOTrainer, or a subclass) to sp=``sp``.

    Call it after building the trainer and before ``train()``; launch with torchrun (every
    process runs the script). The processes form a ``(dp, sp)`` mesh with dp = world / sp.
    Returns ``trainer``, whose class is now a subclass of its own with the methods above.
    Memory options, off by default: ``loss_chunk_size`` > 0 computes the ``Trainer`` loss with
    the project's linear cross-entropy over the model's ``lm_head`` in chunks of that many tokens
    (``apply_ulysses(fused_loss=True)``), so no ``[B, S/sp, vocab]`` logits exist at once (TRL's SFT
    and DPO trainers score through TRL's own fused LM head already); ``mlp_tile_size`` and
    ``head_stages`` as ``apply_ulysses``.
    """
    _check(trainer, sp, dict(mlp_tile_size=mlp_tile_size, head_stages=head_stages, loss_chunk_size=loss_chunk_size))
    _fsdp2_on_cpu(trainer)
    world = dist.get_world_size()
    device = trainer.args.device.type
    model = trainer.accelerator.unwrap_model(trainer.model)
    trl_head = next((c.__name__ for c in type(trainer).__mro__ if c.__name__ in SUPPORTED_TRL), None)
    if loss_chunk_size > 0 and trl_head is not None:
        raise ValueError(f"ulysses_trainer: loss_chunk_size={loss_chunk_size}: {trl_head} scores tokens through TRL's "
                         f"own fused LM head (no [B, S/sp, vocab] logits either); leave it at 0")
    if trl_head == "SFTTrainer":
        from .sft import fused_head_refusal as sft_refusal

        reason = sft_refusal(model)
        if reason:
            raise ValueError(reason)
    mesh = init_device_mesh(device, (world // sp, sp), mesh_dim_names=("dp", "sp"))
    kernel = model.config._attn_implementation
    apply_ulysses(model, mesh, mlp_tile_size=mlp_tile_size, head_stages=head_stages, fused_loss=loss_chunk_size > 0,
                  loss_chunk_size=loss_chunk_size)
    bases = [UlyssesTrainerMixin, type(trainer)]
    dpo = any(c.__name__ == "DPOTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)
    if dpo:
        from .dpo import UlyssesDPOMixin, shard_reference, unsharded

        bases.insert(0, UlyssesDPOMixin)
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            ref = trainer.ref_model = shard_reference(trainer, ref)  # under FSDP2 as TRL shards it on GPU
            plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)  # None under DDP
            with unsharded(ref, getattr(plugin, "reshard_after_forward", True)):
                apply_ulysses(trainer.accelerator.unwrap_model(ref), mesh)
    if trl_head == "SFTTrainer":
        from .sft import UlyssesSFTMixin

        bases.insert(0, UlyssesSFTMixin)  # TRL's fused LM head on the slice; its metrics as one process logs them
    trainer.__class__ = type(f"Ulysses{type(trainer).__name__}", tuple(bases), {})
    trainer.ulysses_mesh = mesh
    trainer.ulysses_kernel = kernel
    trainer.ulysses_loss_chunk = loss_chunk_size
    # compute_loss divides by the whole step's token count; DPO's is a per-micro-batch mean of pairs
    trainer.loss_is_scaled_for_ga = None if dpo else True
    return trainer
