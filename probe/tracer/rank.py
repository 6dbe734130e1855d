"""This process's rank, from torch.distributed when initialised, else torchrun's env."""

from __future__ import annotations

import os

import torch


def current_rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0
