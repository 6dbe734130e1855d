"""Step flushes on a worker thread, so encoding and fsyncs overlap the next step.

Jobs run one at a time, in submission order. ``submit`` blocks while
``max_pending`` jobs are unfinished, which bounds the memory held by steps
waiting to be written; a job that failed re-raises its error in the training
thread at the next ``submit`` or at ``drain``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWriter:
    def __init__(self, max_pending: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-writer")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._futures: deque[Future[None]] = deque()

    def submit(self, job: Callable[[], None]) -> None:
        self._reap(block=False)
        self._slots.acquire()
        future = self._executor.submit(job)
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)

    def drain(self) -> None:
        """Wait for every submitted job; re-raise the first failure."""
        self._reap(block=True)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._executor.shutdown(wait=True)

    def _reap(self, block: bool) -> None:
        while self._futures and (block or self._futures[0].done()):
            self._futures.popleft().result()
