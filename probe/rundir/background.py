"""Step flushes on a worker thread, so encoding and fsyncs overlap the next step.

Jobs run one at a time, in submission order. ``submit`` blocks while
``max_pending`` jobs are unfinished, which bounds the memory held by steps
waiting to be written. A job that raised re-raises its error in the training
thread at the next ``submit`` (after that call's own job is queued) or at
``drain``; the session's jobs handle write failures themselves, so what comes
back this way is a deliberate stop (dump's ``on_error="raise"``) or a bug.

A job handed to ``submit`` is always queued, even when waiting for a slot is
interrupted (Ctrl-C): the step's records go to disk, then the interruption
goes on.

A process forked from the one that made the writer has no worker thread (fork copies
the forking thread only): there every call returns at once and does nothing, as the
jobs are the parent's. Before, the child's next ``submit`` or its ``close`` waited
forever for a job no thread would run.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWriter:
    def __init__(self, max_pending: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe-writer")
        self._slots = threading.BoundedSemaphore(max_pending)
        self._futures: deque[Future[None]] = deque()
        self._pid = os.getpid()

    def _in_forked_child(self) -> bool:
        return os.getpid() != self._pid

    def submit(self, job: Callable[[], None]) -> None:
        if self._in_forked_child():
            return
        try:
            self._slots.acquire()
        except BaseException:
            # Interrupted while the previous step is being written: queue this one beyond the
            # bound (the single worker still runs it after that one) and let the interruption go on.
            self._futures.append(self._executor.submit(job))
            raise
        future = self._executor.submit(job)
        future.add_done_callback(lambda _: self._slots.release())
        self._futures.append(future)
        self._reap(block=False)

    def drain(self) -> None:
        """Wait for every submitted job; re-raise the first failure."""
        if self._in_forked_child():
            return
        self._reap(block=True)

    def close(self) -> None:
        if self._in_forked_child():
            return
        try:
            self.drain()
        finally:
            self._executor.shutdown(wait=True)

    def _reap(self, block: bool) -> None:
        while self._futures and (block or self._futures[0].done()):
            self._futures.popleft().result()
