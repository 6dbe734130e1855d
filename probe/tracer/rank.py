"""Which process of a job this is: rank and world size from torch.distributed when
initialised, else from torchrun's environment (``RANK``, ``WORLD_SIZE``), else a
single process (rank 0 of 1)."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch

from probe.devices import current_device
from probe.rundir.environment import environment_info


def _initialized() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def current_rank() -> int:
    if _initialized():
        return torch.distributed.get_rank()
    found = _env_int("RANK", "LOCAL_RANK")
    return 0 if found is None else found


def world_size() -> int:
    if _initialized():
        return torch.distributed.get_world_size()
    found = _env_int("WORLD_SIZE", "LOCAL_WORLD_SIZE")
    return 1 if found is None else found


def process_info() -> dict[str, Any]:
    """What a rank's ``rank.json`` says about the process that wrote it."""
    info: dict[str, Any] = {
        "rank": current_rank(),
        "world_size": world_size(),
        "local_rank": _env_int("LOCAL_RANK"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "backend": torch.distributed.get_backend() if _initialized() else None,
    }
    device = current_device()
    if device is not None:
        info["device"] = str(device)
    # What probe compare lists first when two runs differ: versions, devices, settings, variables.
    info["environment"] = environment_info()
    return info
