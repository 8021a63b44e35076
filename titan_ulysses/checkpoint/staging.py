"""The host stager of ``async_with_pinned_mem`` saves: DCP's ``DefaultStager``, kept usable across saves.

One stager serves the whole run, so its host buffers (pinned when CUDA is there) are
allocated at the first save and reused. Some torch releases (2.11, the GPU machine's, and
2.13 development builds) close the inner ``StateDictStager`` at the end of every stage; closing
empties its deepcopy dispatch table, and the next save then fails on the first class object
in the state (every DTensor's spec holds several) with ``KeyError: <class 'type'>`` -- found
by the GPU suite (docs/benchmarks.md). ``ReusableStager`` rebuilds the inner stager when it
finds it closed, and otherwise leaves it, and its cached buffers, alone.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class ReusableStager(DefaultStager):
    """A synchronous ``DefaultStager`` (the write runs in the background) that survives being closed per save."""

    def __init__(self, pinned: bool):
        super().__init__(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        inner = getattr(self, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):  # closed by the last save
            self._state_dict_stager = StateDictStager(
                pin_memory=self._config.use_pinned_memory, share_memory=self._config.use_shared_memory)
        return super().stage(state_dict, **kwargs)
