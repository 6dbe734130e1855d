"""The monitor's cross-rank reduction (``reduce_ranks=True``): each step's raw statistics rows
reduced element-wise over the ranks, each raw column as the statistics table combines it (min of
mins, max of maxes, sums of the rest, element counts included so the mean is over every rank's
elements).

Started on the training thread at the step's end, where the model's collectives are issued (the
writer thread issuing its own would interleave with them differently on each rank), and awaited
on the writer thread (:meth:`Reduction.result`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.errors import ProbeError, warn_once
from probe.modes.statistics.capture import PendingRows
from probe.modes.statistics.columns import RAW_COLUMNS, REPEATS, combine_ops
from probe.tracer.mode_stack import untraced

_MIN_COLUMNS, _MAX_COLUMNS, _SUM_COLUMNS = combine_ops()


@dataclass
class Reduction:
    """A step's cross-rank reduction in flight: the collectives' buffers and their works, the
    raw columns combined as the statistics table says (``columns.RawColumn.combine``)."""

    extremes: torch.Tensor  # -x of the min columns, x of the max columns; all-reduced with MAX
    sums: torch.Tensor  # the summed columns and the element count, all-reduced with SUM
    works: list[Any]

    def result(self) -> torch.Tensor:
        """Wait for the collectives (on the writer thread); the reduced whole raw rows and counts."""
        for work in self.works:
            work.wait()
        n = len(_MIN_COLUMNS)
        out = torch.empty((self.sums.shape[0], len(RAW_COLUMNS) + 1), dtype=self.sums.dtype,
                          device=self.sums.device)
        out[:, _MIN_COLUMNS] = -self.extremes[:, :n]
        out[:, _MAX_COLUMNS] = self.extremes[:, n:]
        out[:, [*_SUM_COLUMNS, len(RAW_COLUMNS)]] = self.sums
        return out


def start_reduction(pending: PendingRows, replicas: list[int]) -> Reduction | None:
    """Start the element-wise reduction over ranks of a step's rows (``replicas``: how many ranks
    hold each row's tensor whole, whose sums are divided by it); None without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        warn_once("monitor-reduce", "monitor: reduce_ranks=True without an initialized process group; "
                  "each rank writes its own values")
        return None
    with torch.no_grad(), untraced():
        if len(pending):
            raw = pending.on_device()
            numel, multiplicity = pending.counts()
            m = torch.tensor(multiplicity, dtype=torch.float64, device=raw.device)
            repeats = torch.tensor(REPEATS, device=raw.device)
            raw = torch.where(repeats[None, :], raw * m[:, None], raw)  # whole tensors (columns.whole)
            counts = torch.tensor(numel, dtype=torch.float64, device=raw.device) * m
            stacked = torch.cat([raw, counts[:, None]], dim=1)
        else:
            stacked = torch.zeros((0, len(RAW_COLUMNS) + 1), dtype=torch.float64)
        # Collectives of different sizes would mismatch (a hang or garbage): agree on the
        # series count first. The one wait here, on a tiny tensor (on the CPU when the
        # process group can reduce there).
        n = stacked.shape[0]
        count_device = "cpu" if "gloo" in str(dist.get_backend()) else stacked.device
        agreed = torch.tensor([n, -n], dtype=torch.float64, device=count_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if agreed[0] != -agreed[1]:
            raise ProbeError("monitor reduce_ranks: ranks collected different numbers of series this "
                             f"step ({int(-agreed[1])} to {int(agreed[0])}); monitor the same modules on "
                             "every rank")
        extremes = torch.cat([-stacked[:, _MIN_COLUMNS], stacked[:, _MAX_COLUMNS]], dim=1)
        sums = stacked[:, [*_SUM_COLUMNS, len(RAW_COLUMNS)]]
        if any(r > 1 for r in replicas):  # held by several ranks: count each element once
            sums /= torch.tensor(replicas, dtype=sums.dtype, device=sums.device)[:, None]
        if n == 0:  # every rank has nothing: no buffers to reduce
            return Reduction(extremes, sums, [])
        works = [dist.all_reduce(extremes, op=dist.ReduceOp.MAX, async_op=True),
                 dist.all_reduce(sums, op=dist.ReduceOp.SUM, async_op=True)]
    return Reduction(extremes, sums, works)
