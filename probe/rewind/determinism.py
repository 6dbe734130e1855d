"""Telling a transient fault's cause: a one-off (hardware) from non-determinism, of a kernel or of
the program.

A transient verdict means a rerun from the kept start ended differently from the original. A second
rerun decides: the two reruns agree bit for bit, so the original alone was the odd one out, a
**one-off** (hardware: a flipped bit, a faulty unit; or non-determinism too rare for two reruns to
show it); the reruns differ too, so the step does not reproduce itself: **non-determinism**, and two
more reruns under ``torch.use_deterministic_algorithms(True)`` tell whose: they agree, a **kernel**'s
(an atomic-add reduction, a scatter, which the flag swaps for a deterministic one); they still
differ, the **program**'s (the step reads something its kept start does not hold: a global counter,
the clock, an unseeded generator, Python state).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

HARDWARE = "hardware"
KERNEL = "non-determinism (kernel)"
PROGRAM = "non-determinism (program)"
CAUSES = (HARDWARE, KERNEL, PROGRAM)
"""A transient verdict's ``cause``."""


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Torch's deterministic algorithms on (warning, not raising, where an op has none; cuDNN's
    autotuner off), the settings before put back afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    # Set inside the try: a setting that raises must not leave the other one on for the whole process.
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # set_flags, not the attribute: it raises once torch.backends.disable_global_flags() ran
        # (torch's test utilities call it on import, torch.distributed's fake process group among them).
        torch.backends.cudnn.set_flags(_benchmark=False)
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.set_flags(_benchmark=benchmark)
