"""A StatefulDataLoader whose position is global, so a checkpoint resumes at any layout.

Step t consumes global samples ``[t*G, (t+1)*G)`` (G the global batch size). Data-parallel
rank r takes the contiguous chunk ``[t*G + r*G/dp, t*G + (r+1)*G/dp)``, in microbatches of
``local_batch_size``. The saved state is ``samples_consumed`` (whole steps only), which
means the same thing at every dp size and batch split: after a resume at another layout
the run sees exactly the samples the uninterrupted run would have seen.

The state also records the data settings (dataset, path, tokenizer, seq_len, seed, ...):
a global index means the same samples only under the same settings, so resuming with
other ones is refused, naming what changed, unless ``allow_change``.
"""

from __future__ import annotations

import json

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class GlobalOrderShard(IterableDataset):
    """This dp rank's share of each global batch, in global sample order."""

    def __init__(self, dataset, global_batch_size: int, dp_rank: int, dp_size: int,
                 settings: dict | None = None, allow_change: bool = False):
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.settings, self.allow_change = settings, allow_change
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
        state = {"samples_consumed": self.samples_consumed + done}
        if self.settings is not None:
            state["data_settings"] = json.dumps(self.settings, sort_keys=True)
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.settings is not None and "data_settings" in state:
            check_settings(json.loads(state["data_settings"]), self.settings, self.allow_change)
        self.samples_consumed = int(state["samples_consumed"])
        self._yielded = 0


class DataLoader(StatefulDataLoader):
    """StatefulDataLoader that checks the data settings when a state is loaded, not at the next iter()."""

    def load_state_dict(self, state_dict: dict) -> None:
        shard, saved = self.dataset, (state_dict.get("dataset_state") or {}).get("data_settings")
        if saved is not None and shard.settings is not None:
            check_settings(json.loads(saved), shard.settings, shard.allow_change)
        super().load_state_dict(state_dict)


class WithoutSettings:
    """Loads a checkpoint written before the data settings were recorded: nothing to check."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        state = self.loader.state_dict()
        state["dataset_state"] = {k: v for k, v in state["dataset_state"].items() if k != "data_settings"}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


# Recorded since a later version: a checkpoint without them is not refused for lacking them.
LATER_SETTINGS = {"tokenizer_content", "dataset_content"}
# Recorded by older versions only (the tokenizer's path; its content replaced it).
FORMER_SETTINGS = {"tokenizer_path"}


def check_settings(saved: dict, current: dict, allow_change: bool) -> None:
    """Refuse to resume on other data than the checkpoint's, naming every setting that changed."""
    keys = [k for k in sorted(set(saved) | set(current))
            if not (k in LATER_SETTINGS and k not in saved) and not (k in FORMER_SETTINGS and k not in current)]
    changed = [f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)]
    if changed and not allow_change:
        from titan_ulysses.data.sources import DataError

        raise DataError(
            f"the checkpoint was written with other data settings ({'; '.join(changed)}); resuming would read "
            f"other samples than the run did. Restore them, or set checkpoint.allow_data_change = true to continue "
            f"on the new data from the same global sample index"
        )


def build_dataloader(dataset, *, global_batch_size: int, local_batch_size: int, dp_rank: int, dp_size: int,
                     settings: dict | None = None, allow_change: bool = False):
    if global_batch_size % (local_batch_size * dp_size):
        raise ValueError(
            f"training.global_batch_size {global_batch_size} is not a multiple of "
            f"training.local_batch_size x dp = {local_batch_size} x {dp_size}"
        )
    shard = GlobalOrderShard(dataset, global_batch_size, dp_rank, dp_size, settings, allow_change)
    return DataLoader(shard, batch_size=local_batch_size, num_workers=0)
