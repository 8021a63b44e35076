"""A progress bar (tqdm, rank 0) while a Hugging Face folder's safetensors load through DCP.

``HuggingFaceStorageReader`` reads every tensor slice this rank needs in one ``read_data``
call; the subclass counts the slices as they are copied (``_process_read_request`` is the
reader's per-slice step; if a PyTorch release renames it the bar simply stays at 0).
"""

from __future__ import annotations

from torch.distributed.checkpoint import HuggingFaceStorageReader


class ProgressReader(HuggingFaceStorageReader):
    def __init__(self, path: str, thread_count: int = 1, enabled: bool = True):
        super().__init__(path, thread_count=thread_count)
        self.enabled, self._bar = enabled, None

    def read_data(self, plan, planner):
        from tqdm import tqdm

        self._bar = tqdm(total=len(plan.items), unit="tensor", desc=f"loading {self.path}", mininterval=1.0,
                         disable=not self.enabled, dynamic_ncols=True)
        try:
            return super().read_data(plan, planner)
        finally:
            self._bar.close()
            self._bar = None

    def _process_read_request(self, f, req, planner) -> None:
        super()._process_read_request(f, req, planner)
        if self._bar is not None:
            self._bar.update(1)
