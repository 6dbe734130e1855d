"""The objects a program made before tracing began, left out of Python's garbage collections
while it runs.

Tracing keeps each op's record until its step is written. The records outlive the young
collections they meet, so the collector promotes them to its oldest generation, and once
enough have been promoted it runs a full collection, which walks every object the program
holds: a model's modules, torch's and transformers' own, a dataset's. Training without the
probe allocates almost no such objects per step and meets almost no collection. With it,
on ``hf-llama-small`` (457k objects) one full collection cost 200 ms or more and came every
12 steps or so; a program of millions of objects pays seconds (``benchmarks/gc_pressure.py``).

``gc.freeze()`` when tracing starts moves the program's objects to the collector's permanent
generation, which no collection walks, and ``gc.unfreeze()`` when it stops puts them back:
while tracing, collections walk only what was made since. What that holds back: cyclic
garbage among objects made before tracing began, which a collection while tracing would have
freed, is freed by the first full collection after it ends. Nothing is frozen where the
program froze objects itself (``gc.get_freeze_count()``) or turned the collector off; then
the program's own choice stands.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
"""Tracers running now with the heap frozen (a session and an escalation may overlap)."""
_froze = False
"""Whether the heap is frozen because of them (not by the program)."""


@contextmanager
def frozen_heap(enabled: bool = True) -> Iterator[None]:
    """Freeze the heap while the block runs (see the module's docstring); nested uses share one
    freeze, which the last to leave undoes."""
    global _holders, _froze
    if not enabled:
        yield
        return
    with _lock:
        if _holders == 0 and gc.isenabled() and gc.get_freeze_count() == 0:
            gc.freeze()
            _froze = True
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _froze:
                gc.unfreeze()
                _froze = False
