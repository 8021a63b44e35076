"""A StatefulDataLoader whose position is global, so a checkpoint resumes at any layout.

Step t consumes global samples ``[t*G, (t+1)*G)`` (G the global batch size). Data-parallel
rank r takes the contiguous chunk ``[t*G + r*G/dp, t*G + (r+1)*G/dp)``, in microbatches of
``local_batch_size``. The saved state is ``samples_consumed`` (whole steps only), which
means the same thing at every dp size and batch split: after a resume at another layout
the run sees exactly the samples the uninterrupted run would have seen.
"""

from __future__ import annotations

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class GlobalOrderShard(IterableDataset):
    """This dp rank's share of each global batch, in global sample order."""

    def __init__(self, dataset, global_batch_size: int, dp_rank: int, dp_size: int):
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.per_rank = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.samples_consumed = 0  # global, at the start of the current step
        self._yielded = 0  # samples of the current step yielded by this rank

    def __iter__(self):
        while True:
            base = self.samples_consumed + self.dp_rank * self.per_rank
            while self._yielded < self.per_rank:
                index = base + self._yielded
                self._yielded += 1  # counted before the yield: the generator may never resume
                yield self.dataset[index]
            self.samples_consumed += self.global_batch_size
            self._yielded = 0

    def state_dict(self) -> dict:
        if 0 < self._yielded < self.per_rank:
            raise RuntimeError("data loader state asked for in the middle of a step; save at step boundaries")
        done = self.global_batch_size if self._yielded == self.per_rank else 0
        return {"samples_consumed": self.samples_consumed + done}

    def load_state_dict(self, state: dict) -> None:
        self.samples_consumed = int(state["samples_consumed"])
        self._yielded = 0


def build_dataloader(dataset, *, global_batch_size: int, local_batch_size: int, dp_rank: int, dp_size: int):
    if global_batch_size % (local_batch_size * dp_size):
        raise ValueError(
            f"training.global_batch_size {global_batch_size} is not a multiple of "
            f"training.local_batch_size x dp = {local_batch_size} x {dp_size}"
        )
    shard = GlobalOrderShard(dataset, global_batch_size, dp_rank, dp_size)
    return StatefulDataLoader(shard, batch_size=local_batch_size, num_workers=0)
