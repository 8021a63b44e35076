"""A step's microbatches as this rank trains on them: loader batches, each counted and sharded
over sp (and cp) on the host, then this rank's slice copied onto the device (``sharding.py``).

The host part (:meth:`StepBatches.host`) may run in a prefetch thread (``prefetch.py``); the
upload (:meth:`StepBatches.upload`) runs on the training thread, ``non_blocking`` from pinned
memory on CUDA. A step travels as one :class:`StepData`: the microbatches and their counts (padding
tokens, tokens, truncated samples), uploaded with them so that a logging step finds them on the device
(a blocking copy there would wait for the queued work); nothing reads them here: the trainer reduces
and reads them on logging steps only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from titan_ulysses.data.sharding import SPBatch, shard_host_batch, to_device


COUNTS = ("padding", "tokens", "truncated")
"""What :attr:`StepData.counts` holds, in order: padding tokens, tokens and truncated samples of the step's batches."""


class StepData(NamedTuple):
    """One step's data as this rank trains on it."""

    microbatches: list[SPBatch]
    """This rank's slices of the step's loader batches (``data/sharding.py``), in order."""
    counts: torch.Tensor
    """``[3]`` fp64, :data:`COUNTS` summed over the step's loader batches (this rank's dp group's rows)."""


class StepBatches:
    """``per_step`` microbatches per step for rank (``sp_rank`` of ``sp``, ``cp_rank`` of ``cp``);
    ``packed``: rows hold several documents (attention masks per document)."""

    def __init__(self, per_step: int, sp_rank: int, sp: int, cp_rank: int, cp: int, device: torch.device,
                 packed: bool, pad_id: int):
        self.per_step, self.device, self.packed, self.pad_id = per_step, device, packed, pad_id
        self.sp_rank, self.sp, self.cp_rank, self.cp = sp_rank, sp, cp_rank, cp
        # page-locked host copies make the upload an asynchronous DMA; only with a CUDA device
        self.pin = torch.device(device).type == "cuda" and torch.cuda.is_available()

    def host(self, data_iter) -> StepData:
        """This step's microbatches, sliced for this rank on the host, and their counts (pinned on CUDA)."""
        counts = torch.zeros(len(COUNTS), dtype=torch.float64)
        microbatches = []
        for _ in range(self.per_step):
            batch = next(data_iter)
            truncated = batch["truncated"].sum() if "truncated" in batch else torch.zeros((), dtype=torch.long)
            counts += torch.stack([(batch["document_ids"] == -1).sum(), torch.tensor(batch["input"].numel()),
                                   truncated]).double()
            microbatches.append(shard_host_batch(batch, self.sp_rank, self.sp, self.packed, self.pad_id,
                                                 self.cp_rank, self.cp, pin=self.pin))
        return StepData(microbatches, counts.pin_memory() if self.pin else counts)

    def upload(self, step: StepData) -> StepData:
        """A step from :meth:`host` on the device, microbatches and counts (``non_blocking`` from pinned memory)."""
        return StepData([to_device(b, self.device, non_blocking=self.pin) for b in step.microbatches],
                        step.counts.to(self.device, non_blocking=self.pin))

    def next(self, data_iter) -> StepData:
        """This step on the device (synchronous: :meth:`host` then :meth:`upload`)."""
        return self.upload(self.host(data_iter))
