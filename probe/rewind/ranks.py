"""The ranks of a job rewinding together: each rank keeps its own step's start, and every decision of
a rewind (rewind now; did the rerun recur) is agreed on by all of them with one ``all_reduce``, so
that every rank runs the same reruns and the collectives inside the step meet their peers.

The agreement runs at the step's end and between reruns, untraced: never a host sync inside the
traced step. Outside a process group of more than one rank every answer is this process's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from probe.tracer.mode_stack import untraced


class Ranks:
    """This process's rank in the default process group, and agreement with the others."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

    def _device(self) -> torch.device:
        backend = str(dist.get_backend())
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")

    def codes(self, code: int) -> list[int]:
        """Every rank's ``code`` (a small non-negative int), by rank: one ``all_reduce``."""
        if not self.distributed:
            return [code]
        with untraced():
            gathered = torch.zeros(self.world, dtype=torch.int64, device=self._device())
            gathered[self.rank] = code
            dist.all_reduce(gathered)
            return [int(c) for c in gathered.tolist()]

    def where(self, flag: bool) -> list[int]:
        """The ranks where ``flag`` holds."""
        return [rank for rank, code in enumerate(self.codes(int(flag))) if code]

    def any(self, flag: bool) -> bool:
        return bool(self.where(flag))

    def all(self, flag: bool) -> bool:
        return len(self.where(flag)) == self.world

    def minimum(self, value: int) -> int:
        return min(self.codes(value))
