"""The run's steps of data, prepared ``ahead`` steps in advance by a background thread.

``iter(StepStream)`` yields one step at a time: a ``StepData`` (microbatches and counts, on the device)
(``microbatches.py``). With ``ahead > 0`` a thread reads the loader, slices each batch for this
rank and pins it (on CUDA) while the device trains; the training thread only waits on a queue
and issues the ``non_blocking`` uploads. At most ``ahead`` steps are read and not yet consumed.

The loader's state is a global sample index (``loader.py``), so a step's state can be taken
right after the thread read it, and travels with it: :meth:`StepStream.state_dict` is the state
after the steps *consumed*, never after those only prefetched, and a checkpoint resumes at the
step that follows it. ``ahead = 0`` reads each step on the training thread, as a plain loop.

The thread is a daemon that stops at :meth:`close` (the trainer's ``finally``), and wherever it
stops, a blocked put or a loader error: an error reaches the training thread at its next step.
"""

from __future__ import annotations

import queue
import threading

_POLL_S = 0.05  # how often the training thread, waiting for a step, looks whether the thread died


class StepStream:
    """The steps of ``loader`` as ``batches`` prepares them, ``ahead`` of the training loop."""

    def __init__(self, loader, batches, ahead: int):
        self.loader, self.batches, self.ahead = loader, batches, ahead
        self.dataset = loader.dataset  # the checkpointer looks at it (checkpoints without data settings)
        self._iter = None

    def __iter__(self):
        self.close()  # the previous iteration's thread
        self._iter = _Ahead(self.loader, self.batches, self.ahead) if self.ahead else _Inline(self.loader,
                                                                                              self.batches)
        return self._iter

    def state_dict(self) -> dict:
        """The loader's state after the steps consumed (with prefetch, not after those read ahead)."""
        return self.loader.state_dict() if self._iter is None else self._iter.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._iter = None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the prefetch thread; the state stays that after the steps consumed."""
        if self._iter is not None:
            self._iter.close()


class _Inline:
    """``ahead = 0``: each step read when it is asked for, on the calling thread."""

    def __init__(self, loader, batches):
        self.loader, self.batches, self._it = loader, batches, iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        return self.batches.next(self._it)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def close(self) -> None:
        pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class _Ahead:
    """The prefetch thread and its queue of ``(host step, loader state after it)``."""

    def __init__(self, loader, batches, ahead: int):
        self.loader, self.batches = loader, batches
        self._it = iter(loader)  # on the calling thread: it draws from the global generator (trainer.train)
        self._state = loader.state_dict()  # before any step is consumed
        self._slots = threading.Semaphore(ahead)  # steps read and not yet consumed
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-data-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._slots.acquire()  # blocking, no polling: a woken thread takes the GIL from the step
                if self._stop.is_set():
                    return
                step = self.batches.host(self._it)
                self._queue.put((step, self.loader.state_dict()))
        except BaseException as e:  # handed to the training thread, raised at its next step
            self._queue.put(_Failed(e))

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the data prefetch thread stopped without a step (closed?)") from None
        if isinstance(item, _Failed):
            self._stop.set()
            raise item.error
        step, self._state = item
        step = self.batches.upload(step)
        # the thread starts on the next step only now: it would hold the GIL against the upload (5 ms
        # switches: data_wait 6.5 ms/step instead of 1.6 without prefetch, docs/bench_cpu.md)
        self._slots.release()
        return step

    def state_dict(self) -> dict:
        return self._state

    def close(self) -> None:
        """Stop the thread (it may finish the step it is reading) and drop what it read ahead."""
        self._stop.set()
        self._slots.release()  # wakes the thread if it waits for a slot
        self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()
