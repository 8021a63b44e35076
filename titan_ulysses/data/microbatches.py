"""A step's microbatches as this rank trains on them: loader batches, each counted and sharded
over sp (and cp) on the host, then this rank's slice copied onto the device (``sharding.py``).

The host part (:meth:`StepBatches.host`) may run in a prefetch thread (``prefetch.py``); the
upload (:meth:`StepBatches.upload`) runs on the training thread, ``non_blocking`` from pinned
memory on CUDA. The counts (padding tokens, tokens, truncated samples) stay a host tensor that
nothing reads here: the trainer reduces and reads them on logging steps only.
"""

from __future__ import annotations

import torch

from titan_ulysses.data.sharding import SPBatch, shard_host_batch, to_device


class StepBatches:
    """``per_step`` microbatches per step for rank (``sp_rank`` of ``sp``, ``cp_rank`` of ``cp``);
    ``packed``: rows hold several documents (attention masks per document)."""

    def __init__(self, per_step: int, sp_rank: int, sp: int, cp_rank: int, cp: int, device: torch.device,
                 packed: bool, pad_id: int):
        self.per_step, self.device, self.packed, self.pad_id = per_step, device, packed, pad_id
        self.sp_rank, self.sp, self.cp_rank, self.cp = sp_rank, sp, cp_rank, cp
        # page-locked host copies make the upload an asynchronous DMA; only with a CUDA device
        self.pin = torch.device(device).type == "cuda" and torch.cuda.is_available()

    def host(self, data_iter) -> tuple[list[SPBatch], torch.Tensor]:
        """(this step's microbatches, sliced for this rank on the host, their counts ``[padding tokens,
        tokens, truncated samples]`` in fp64)."""
        counts = torch.zeros(3, dtype=torch.float64)
        microbatches = []
        for _ in range(self.per_step):
            batch = next(data_iter)
            truncated = batch["truncated"].sum() if "truncated" in batch else torch.zeros((), dtype=torch.long)
            counts += torch.stack([(batch["document_ids"] == -1).sum(), torch.tensor(batch["input"].numel()),
                                   truncated]).double()
            microbatches.append(shard_host_batch(batch, self.sp_rank, self.sp, self.packed, self.pad_id,
                                                 self.cp_rank, self.cp, pin=self.pin))
        return microbatches, counts

    def upload(self, step: tuple[list[SPBatch], torch.Tensor]) -> tuple[list[SPBatch], torch.Tensor]:
        """A step from :meth:`host` with its microbatches on the device (the counts stay on the host)."""
        microbatches, counts = step
        return [to_device(b, self.device, non_blocking=self.pin) for b in microbatches], counts

    def next(self, data_iter) -> tuple[list[SPBatch], torch.Tensor]:
        """This step's microbatches on the device, and their counts (synchronous: :meth:`host` then :meth:`upload`)."""
        return self.upload(self.host(data_iter))
