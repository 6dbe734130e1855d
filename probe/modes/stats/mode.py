"""Mode "stats": min, max, mean, L2 norm, NaN and Inf counts of op outputs (inputs optional).

Large results are queued and reduced many at a time, small ones staged (the statistics
engine, ``probe.modes.statistics``): the per-op work is a list append or one copy. Raw rows stay on the
tensor's device until the step ends;
the writer thread moves them to the host and turns raw moments into
statistics. A value is reduced once per step: an input produced by a traced
op reuses that op's output row, and a view that covers exactly the elements of
its base (``view``, ``t``, ``permute``, ``detach``, ...) reuses the base's row
(never a conjugate or negative view: it holds other values). Tensors the tracer
could not key (``OpCall.skipped``: inference, sparse, nested, zero tensors) get
no row.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

import probe.modes.statistics.distribution as distribution_rows
import probe.modes.stats.distribution_files as distribution_files
import probe.modes.stats.fp8_scales as fp8_files
import probe.modes.stats.sketch_files as sketch_files
from probe.modes.base import Mode
from probe.modes.registry import register_mode
from probe.modes.statistics.capture import PendingRows, StepRows
from probe.modes.statistics.finalize import finalize, whole
from probe.modes.statistics.reduce import TensorStats
from probe.modes.statistics.sketch import PendingSketches, SketchRows
from probe.modes.stats.file_names import STATS_FILE, STATS_INDEX_FILE
from probe.modes.stats.files import INPUT, OUTPUT, STAT_NAMES, StatsFiles
from probe.modes.stats.nonfinite_params import NonfiniteParameters, NonfiniteParametersStep
from probe.modes.stats.options import Stats
from probe.rundir.writer import StepWriter
from probe.tracer.op_call import OpCall

_OVERWRITING = frozenset({"copy_", "fill_", "zero_", "split_with_sizes_copy", "_foreach_copy_", "normal_",
                          "uniform_", "bernoulli_", "random_", "exponential_"})
"""In-place ops that write their argument without reading it: its old contents are no input."""
# Views whose elements may overlap or repeat even with the same numel as the base.
_NOT_SAME_ELEMENTS = frozenset({"as_strided", "unfold", "diagonal"})
_UNSAFE_VIEWS = frozenset({"_unsafe_view"})
"""Ops that return a view of their input that autograd is not told of (a reshape's copy it
could skip): the output reuses its input's row as a view's does."""


def _same_elements(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether ``view`` holds exactly the values of ``base`` (a conjugate or negative view
    of it holds others). Of one dtype, the same first element's address is the same storage
    and offset (no storage is looked up: this runs for every view op)."""
    return (
        view.dtype == base.dtype
        and view.numel() == base.numel()
        and view.data_ptr() == base.data_ptr()
        and view.is_conj() == base.is_conj()
        and view.is_neg() == base.is_neg()
    )


def _value_key(t: torch.Tensor) -> tuple[torch.UntypedStorage, tuple[Any, ...]] | None:
    """``t``'s storage and the values ``t`` holds in it (address, layout and version), or None
    for a tensor without one. A tensor dense in its memory, contiguous or a transposed
    contiguous matrix, holds every element of a range once whatever its shape: a weight and its
    transpose (a linear layer reads both) have one key. The address is part of it: FSDP2 moves
    a live storage's memory (``resize_``) without a new version."""
    try:
        storage = t.untyped_storage()
        where, version = t.data_ptr(), t._version
        if t.is_contiguous() or (t.dim() >= 2 and t.mT.is_contiguous()):
            return storage, (where, t.numel(), version, t.dtype, t.is_conj(), t.is_neg())
        return storage, (where, tuple(t.shape), t.stride(), version, t.dtype, t.is_conj(), t.is_neg())
    except (RuntimeError, NotImplementedError):
        return None


@register_mode
class StatsMode(Mode):
    """Per-op tensor statistics, computed on device (sums in fp64), one transfer per step."""

    name = "stats"
    config_class = Stats
    files = StatsFiles

    def __init__(self, config: Stats) -> None:
        super().__init__(config)
        # Opt-in: a few more reductions per recorded tensor (docs/stats.md, "Distribution").
        self._distribution = (distribution_rows.DistributionRows(config.histogram)
                              if config.distribution or config.histogram else None)
        self._sketches = SketchRows() if config.sketch else None
        self._describing = self._distribution is not None or self._sketches is not None  # (per row: no call)
        self._fp8 = fp8_files.Fp8Scales()
        self.inputs = config.inputs
        self._rows = StepRows(
            TensorStats(config.stats_backend), stage=config.stats_backend == "auto",
            saturation=config.saturation,
            sketches=self._sketches,
        )
        self._parameters = NonfiniteParameters()
        self._reset()

    def attach(self, model: Any, out: Path, rank: int) -> None:
        """With ``model=``: name its parameters that hold NaN/Inf at each step's start and the
        gradients that do before each optimizer step (see ``nonfinite_params``)."""
        if model is not None:
            self._parameters.attach(model)

    def begin_step(self, step: int) -> None:
        self._parameters.begin_step()

    def close(self) -> None:
        self._parameters.close()

    def _reset(self) -> None:
        self._index: list[tuple[int, int, int, int]] = []  # (op index, INPUT/OUTPUT, position, row)
        self._output_rows: dict[tuple[int, int], int] = {}
        self._input_rows: dict[int, int] = {}  # current op: input position -> row
        # Inputs from outside the step by storage (its ``_cdata``: a freed storage's may come back
        # with the next one allocated, so each entry has a weak reference to its own), then by
        # value (``_value_key``) -> row.
        self._external_rows: dict[int, tuple[weakref.ref, dict[tuple[Any, ...], int]]] = {}

    def _describe(self, t: torch.Tensor, row: int) -> None:
        """What the options ask of a new row's values beyond its statistics, taken now."""
        if self._distribution is not None:
            self._distribution.add(t, row)
        if self._sketches is not None:
            self._sketches.add(t, row, queued=self._rows.queued(row))

    def _input_row(self, call: OpCall, position: int) -> int | None:
        row = self._input_rows.get(position)
        if row is not None:
            return row
        source = call.inputs[position][2]
        if source is not None and source[2]:
            return self._output_rows.get((source[0], source[1]))
        return None

    def before(self, call: OpCall) -> None:
        if self._rows.due:
            self._rows.settle()
        if self._input_rows:
            self._input_rows = {}
        info = call.info
        if info.mutates:
            # Queued results about to be overwritten are reduced first (see statistics.capture).
            self._rows.before_write(call.written())
        # Read now, and their rows describe no later read (``OpCall.written_unannounced``: a
        # collective's inputs; other ops have none, asked for no call).
        unannounced_tensors = call.written_unannounced() if info.is_collective else ()
        unannounced = self._storages(unannounced_tensors) if unannounced_tensors else ()
        if unannounced:
            self._rows.before_write(unannounced_tensors)
        if not self.inputs or (self.inputs == "external" and call.uninitialized):
            return  # a view into memory nothing wrote yet (FSDP2's reallocated buffers): garbage
        every = self.inputs is True
        if not every and not unannounced:
            for meta in call.inputs:
                if meta[2] is None:
                    break
            else:
                return  # every input computed in the step: its producer's output row describes it
        # An input the op writes is read now: queued, its statistics would be the op's result's.
        written = {w.untyped_storage()._cdata for w in call.written()} if info.mutates else ()
        overwrites = bool(written) and (info.is_out or info.is_collective or info.namespace != "aten"
                                        or info.short in _OVERWRITING)
        if written or unannounced:
            self._rows.hold()  # the inputs read now, reduced together below (a foreach op's 32)
            try:
                self._read_inputs(call, every, written, overwrites, unannounced)
            finally:
                self._rows.release()
        else:
            self._read_inputs(call, every, written, overwrites, unannounced)
        for storage in unannounced:
            self._external_rows.pop(storage, None)

    def _read_inputs(self, call: OpCall, every: bool, written: Any, overwrites: bool,
                     unannounced: Any) -> None:
        for position, t in enumerate(call.input_tensors or ()):
            if call.skipped and call.skip_reason("in", position) is not None:
                continue
            if not every and call.inputs[position][2] is not None:
                continue  # computed in the step: its producer's output row describes it
            if not every and overwrites and t.untyped_storage()._cdata in written:
                continue  # a buffer the op fills (out=, a collective's, FSDP2's): no value yet
            row = self._input_row(call, position)
            keyed = None if every else _value_key(t)
            values = None
            if keyed is not None:
                known = self._external_rows.get(keyed[0]._cdata)
                if known is not None and known[0]() is keyed[0]:
                    values = known[1]
                    if row is None:
                        row = values.get(keyed[1])  # a weight read by several ops: reduced once
            if row is None:
                storage = keyed[0]._cdata if keyed is not None else t.untyped_storage()._cdata
                row = self._rows.add(t, now=(bool(written) and storage in written) or storage in unannounced)
                if row is not None and self._describing:
                    self._describe(t, row)
                if row is not None and keyed is not None:
                    if values is None:
                        values = {}
                        self._external_rows[keyed[0]._cdata] = (weakref.ref(keyed[0]), values)
                    values[keyed[1]] = row
            if row is not None:
                self._input_rows[position] = row
                self._index.append((call.index, INPUT, position, row))

    def after(self, call: OpCall) -> None:
        if call.uninitialized:
            return
        outputs = call.output_tensors or ()
        inputs = call.input_tensors or ()
        info = call.info
        if info.name not in self._fp8.unscaled:
            self._fp8.add(call.index, call.func, call.args, call.kwargs, inputs, info.name)
        reuse_base = (
            (info.is_view or info.short in _UNSAFE_VIEWS) and inputs
            and info.short not in _NOT_SAME_ELEMENTS
        )
        if info.memory_managed_outside:
            # FSDP2 reallocates what its ops write between uses, outside any op, where
            # before_write cannot see it: never queued.
            self._rows.unstable(outputs)
        skipped = call.skipped
        if skipped and reuse_base and call.skip_reason("in", 0) is not None:
            reuse_base = False
        volatile = self._rows.volatile
        if reuse_base and volatile and inputs[0].untyped_storage()._cdata in volatile:
            # Memory the program frees and refills outside any op (FSDP2's unsharded
            # parameters): the value it held when its row was taken may be another one now.
            reuse_base = False
        # Only a writing op (or a deferred collective, whose writes are another op's) moves a
        # version: the others are spared the call.
        moving = (call.versions_moving() if info.mutates or call.writes_in_flight is not None
                  else ())
        for position, t in enumerate(outputs):
            if skipped and call.skip_reason("out", position) is not None:
                continue
            row = None
            if reuse_base and _same_elements(t, inputs[0]):
                row = self._input_row(call, 0)
            if row is None:
                version_moves = False
                for m in moving:  # (a loop, not any() over a generator: two calls per output)
                    if t is m:
                        version_moves = True
                        break
                row = self._rows.add(t, version_moves=version_moves,
                                     counter=inputs[0] if call.info.is_view and inputs else None)
                if row is not None and self._describing:
                    self._describe(t, row)
            if row is None:
                continue
            self._output_rows[(call.index, position)] = row
            self._index.append((call.index, OUTPUT, position, row))

    @staticmethod
    def _storages(tensors: Any) -> set[int]:
        """The storages of ``tensors`` (those that have one: not a wrapper subclass, a meta tensor)."""
        storages = set()
        for t in tensors:
            try:
                storages.add(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue
        return storages

    def end_step(self, step: int) -> StatsStep:
        result = StatsStep(self._rows.end_step(), self._index, self._parameters.end_step())
        result.distribution = self._distribution.end_step() if self._distribution is not None else None
        result.sketches = self._sketches.end_step() if self._sketches is not None else None
        result.fp8_scales = self._fp8.take()
        self._reset()
        return result


class StatsStep:
    """One step's statistics: rows still on their devices, and which tensor uses which row."""

    distribution: distribution_rows.PendingDistribution | None = None
    sketches: PendingSketches | None = None
    fp8_scales: Any = ()  # each step sets its own list

    def __init__(self, rows: PendingRows, index: list[tuple[int, int, int, int]],
                 parameters: NonfiniteParametersStep) -> None:
        self.rows, self.index, self.parameters = rows, index, parameters

    def write(self, writer: StepWriter) -> dict[str, Any]:
        stats = finalize(*whole(*self.rows.to_host()), STAT_NAMES)
        index = np.array(self.index, dtype=np.int64).reshape(-1, 4)
        lost = self.rows.lost()
        if lost:  # tensors without statistics are left out of the index: not measured
            index = index[~np.isin(index[:, 3], lost)]
        writer.write_array(STATS_FILE, stats)
        writer.write_array(STATS_INDEX_FILE, index)
        nonfinite = int(np.count_nonzero((stats[:, 4] + stats[:, 5]) > 0))
        summary = {"rows": len(stats), "tensors": len(index), "nonfinite_rows": nonfinite,
                   "nonfinite_parameters": self.parameters.summary()}
        if lost:
            summary["unmeasured_tensors"] = len(lost)
        if self.distribution is not None:
            summary.update(distribution_files.write_files(writer, self.distribution, len(stats)))
        if self.sketches is not None:
            summary.update(sketch_files.write_file(writer, self.sketches, len(stats)))
        summary.update(fp8_files.write_file(writer, self.fp8_scales))
        return summary
