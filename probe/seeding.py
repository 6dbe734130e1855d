"""``probe.seed_all``: one call that makes two runs of a program start alike and, with
``deterministic=True``, compute alike.

It seeds every generator a training script draws from (Python's ``random``, NumPy's
global generator, torch's CPU generator and every accelerator's, through
``torch.manual_seed``) and, when asked, turns on torch's deterministic algorithms and
the environment variables the device libraries read for them. What it did is kept
(:func:`seeded`) and written into the ``run.json`` of the next session, so ``probe
compare`` can say that two runs were seeded differently.

Limits, said here because no call can fix them: ``PYTHONHASHSEED`` is read when Python
starts, so setting it reaches only child processes (DataLoader workers started with
spawn, torchrun's children); ``CUBLAS_WORKSPACE_CONFIG`` is read when cuBLAS makes its
workspace, so call this before the first matmul on the GPU; NumPy ``Generator``
objects made with ``default_rng`` are the caller's to seed.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from probe.errors import ProbeError, warn_once

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's documented setting for reproducible results (``:16:8`` uses less memory; either is kept)."""
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")

DETERMINISTIC_ENVIRONMENT = {
    # cuBLAS: a fixed workspace, without which torch's deterministic mode refuses CUDA matmuls.
    "CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE,
    # Ascend HCCL: reductions in a fixed order (torch_npu reads it when its communicator is made).
    "HCCL_DETERMINISTIC": "true",
}
"""The variables ``deterministic=True`` sets (an existing deterministic value is kept)."""

_last: dict[str, Any] | None = None


def seeded() -> dict[str, Any] | None:
    """What the last :func:`seed_all` of this process did (None: never called); recorded in
    ``run.json`` as ``seed``."""
    return None if _last is None else dict(_last)


def _check_seed(seed: Any) -> int:
    # NumPy's global generator takes 0 .. 2**32 - 1; a bool is refused, not read as 0/1.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ProbeError(f"seed_all: seed must be an int from 0 to 2**32 - 1, got {seed!r}")
    return seed


def seed_all(seed: int, deterministic: bool = True, warn_only: bool = False) -> dict[str, Any]:
    """Seed Python, NumPy, torch and every accelerator's generator with ``seed``.

    ``deterministic=True`` also calls ``torch.use_deterministic_algorithms(True,
    warn_only=warn_only)`` (an op without a deterministic kernel then raises, or warns with
    ``warn_only``), sets cuDNN to deterministic kernels without autotuning, and sets the
    environment variables of :data:`DETERMINISTIC_ENVIRONMENT` (cuBLAS, Ascend HCCL);
    ``deterministic=False`` seeds only and leaves those settings as they are. Returns what
    was done (the ``seed`` entry of the next session's ``run.json``).

    >>> probe.seed_all(0)                        # before building the model and the data
    """
    global _last
    seed = _check_seed(seed)
    if not isinstance(deterministic, bool) or not isinstance(warn_only, bool):
        raise ProbeError(f"seed_all: deterministic and warn_only must be True or False, got "
                         f"{deterministic!r} and {warn_only!r}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # the CPU generator and each accelerator's (CUDA, NPU, XPU, MPS)
    environment = {"PYTHONHASHSEED": str(seed)}  # for child processes: this one hashed at start
    if deterministic:
        cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        kept = cublas if cublas in _CUBLAS_DETERMINISTIC else None
        environment["CUBLAS_WORKSPACE_CONFIG"] = kept or CUBLAS_WORKSPACE
        environment["HCCL_DETERMINISTIC"] = DETERMINISTIC_ENVIRONMENT["HCCL_DETERMINISTIC"]
        if cublas not in _CUBLAS_DETERMINISTIC and torch.cuda.is_available() and torch.cuda.is_initialized():
            warn_once("seed-all-cublas", "seed_all: CUDA was initialised before CUBLAS_WORKSPACE_CONFIG was "
                      "set; cuBLAS workspaces made before keep their size: call probe.seed_all before the "
                      "first CUDA matmul")
    os.environ.update(environment)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        # set_flags, not the attributes: those raise once torch.backends.disable_global_flags()
        # ran (torch's own test utilities call it on import).
        torch.backends.cudnn.set_flags(_benchmark=False, _deterministic=True)
    _last = {"seed": seed, "deterministic": deterministic, "warn_only": warn_only, "environment": environment}
    return dict(_last)


def worker_init_fn(worker_id: int) -> None:
    """A ``DataLoader(worker_init_fn=...)`` that seeds each worker's ``random`` and NumPy from
    the seed torch gave the worker (torch seeds only its own generator in workers)."""
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
