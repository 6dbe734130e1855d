"""Reading a run directory: ``probe.load(path)`` returns a :class:`Run`.

Steps are loaded lazily, and only the few most recently used steps stay in
memory (:data:`STEPS_KEPT`), so reading a run of any length takes the memory of a
few steps.

This module reads the files every step has (manifest, op records, call sites,
modules); a mode's own files are read by the mode's reader, kept beside its writer
and found through the mode registry (:mod:`probe.rundir.mode_files`): the stats mode's
reader attaches statistics to the op records (an input that was produced by a traced
op in the same step shares that op's output statistics even when input statistics
were not collected), free_benchmark's reads the checks, monitor's the series and
alerts, dump's the dump index. ``run.mode(name)`` reads one mode over the whole run (the mode's
``run_reader``); ``checks``, ``monitor``, ``anomalies``, ``nonfinite_parameters``,
``output_stats``, ``has_dump``, ``dump`` and ``tensor`` are aliases of it. A step listing a mode
the registry does not know is read without that mode's files, with one warning.

Every file is read through :mod:`probe.rundir.untrusted_reads`: damage to a run's metadata
is a :class:`ProbeError` naming the file, never another exception. A run is untrusted input:
files are opened only through :mod:`probe.rundir.confined_files` (regular files inside the
run), and a rank directory that is a link leading outside the run is refused.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar, cast

import networkx as nx
import numpy as np
import torch

from probe.errors import ProbeError, warn_once
from probe.rundir import layout
from probe.rundir.call_site_table import CallSiteTable
from probe.rundir.confined_files import check_directory
from probe.rundir.loss_scaler import (
    SCALER_OP_PREFIX,
    ScalerStep,
    handled_by_scaler,
    scaler_step,
    scaler_step_in,
)
from probe.rundir.mode_files import (  # the modes sit above: their readers are found in a registry
    ModeFiles,
    ModeReader,
    StepFiles,
    registered_mode_files,
)
from probe.rundir.nonfinite_origins import nonfinite_origins_in
from probe.rundir.op_graph import build_graph
from probe.rundir.op_lines import OpLines
from probe.rundir.op_record_json import decode as decode_op_record
from probe.rundir.op_record_json import layout_record as encode_layout
from probe.rundir.rank_origin import RankOrigin, rank_origin
from probe.rundir.records import (
    OpRecord,
    StepInfo,
    TensorRecord,
    WriteFailure,
)
from probe.rundir.untrusted_reads import (
    OP_LINE_LIMIT,
    READ_ERRORS,
    expect,
    parse_json,
    read_json,
    read_jsonl,
    reading,
    record_from_row,
)

__all__ = ["DamagedStep", "OpRecord", "Run", "StepInfo", "TensorRecord", "WriteFailure", "load"]

STEPS_KEPT = 8
"""How many (step, rank) entries of each per-step cache a Run keeps (least recently used goes)."""
OPS_BATCH = 1 << 14
"""How many op records :meth:`Run.iter_ops` decodes at a time."""

K = TypeVar("K")
V = TypeVar("V")


class _Place(NamedTuple):
    """A flushed step of a rank, or (``tail``) the rank's tail numbered as that step."""

    step: int
    rank: int
    tail: bool = False

    def directory(self, run: Path) -> Path:
        return (layout.tail_dir if self.tail else layout.step_dir)(run, self.rank, self.step)


class _Recent(Generic[K, V]):
    """A cache of the ``size`` most recently used values, loaded on a miss."""

    def __init__(self, load: Callable[[K], V], size: int = STEPS_KEPT) -> None:
        self._load, self._size = load, size
        self._values: OrderedDict[K, V] = OrderedDict()

    def __call__(self, key: K) -> V:
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = self._load(key)
        self._values[key] = value
        if len(self._values) > self._size:
            self._values.popitem(last=False)
        return value

    def peek(self, key: K) -> V | None:
        """The value when it is cached, without loading it or changing the order."""
        return self._values.get(key)

    def __len__(self) -> int:
        return len(self._values)


def _check_version(path: Path, version: Any) -> None:
    if type(version) is not int or not 1 <= version <= layout.FORMAT_VERSION:
        hint = ": upgrade probe to read it" if type(version) is int and version > 0 else ""
        raise ProbeError(f"{str(path)!r} has format version {version!r}; this probe reads versions "
                         f"1 to {layout.FORMAT_VERSION}{hint}")


_POLICY_PHASES = frozenset({"forward", "recompute"})
"""The phases whose ops carry the autocast policy they ran under (``probe.tracer.autocast_policy``)."""


def _autocast_policies(manifest: dict[str, Any], path: Path) -> list[dict[str, str]] | None:
    """A step's autocast policies by id (``layout.AUTOCAST_KEY``); None in runs written before it."""
    table = manifest.get(layout.AUTOCAST_KEY)
    if table is None:
        return None
    with reading(path):
        for policy in expect(table, list, layout.AUTOCAST_KEY):
            for device, dtype in expect(policy, dict, "an autocast policy").items():
                expect(dtype, str, f"autocast's dtype for {device!r}")
    return table


class DamagedStep(NamedTuple):
    """A flushed step that cannot be read: which, and why (the :class:`ProbeError`'s message,
    naming the file)."""

    step: int
    rank: int
    reason: str

    def describe(self) -> str:
        return f"step {self.step} rank {self.rank}: unreadable, skipped: {self.reason}"


class Run:
    """A run directory: its steps, ranks, op records, graphs and findings."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        run_file = self.path / layout.RUN_FILE
        if not run_file.is_file():
            raise ProbeError(f"{str(self.path)!r} is not a probe run directory (no {layout.RUN_FILE})")
        self.info: dict[str, Any] = read_json(run_file, run=self.path)
        if self.info.get("format") != layout.FORMAT_NAME:
            raise ProbeError(f"{str(run_file)!r} is not a probe run (format {self.info.get('format')!r}, "
                             f"expected {layout.FORMAT_NAME!r})")
        _check_version(run_file, self.info.get("format_version"))
        with reading(run_file):
            expect(self.info.get("modes", []), list, "modes")
        self._ops = _Recent[_Place, list[OpRecord]](self._load_ops)
        self._step_info = _Recent[_Place, StepInfo](self._load_step_info)
        self._lines = _Recent[_Place, OpLines](self._index_op_lines)
        self._sites = _Recent[_Place, CallSiteTable | None](self._load_call_sites)
        # Per step: each mode's reader, made when first asked for (None: the step has no such files).
        self._files = _Recent[_Place, dict[str, ModeFiles | None]](lambda place: {})
        self._damage: dict[tuple[int, int], str | None] = {}
        self._readers: dict[str, ModeReader] = {}
        """(step, rank) -> why it cannot be read (None: read whole), for the steps checked so far."""

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, steps={self.steps}, ranks={self.ranks})"

    # -- what is there -----------------------------------------------------------

    @cached_property
    def ranks(self) -> list[int]:
        with reading(self.path):
            return layout.list_ranks(self.path)

    @cached_property
    def _steps_by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        for rank in self.ranks:  # its steps are listed (read) only when it lies inside the run
            check_directory(layout.rank_dir(self.path, rank), self.path)
        with reading(self.path):
            return {rank: layout.list_steps(self.path, rank) for rank in self.ranks}

    @cached_property
    def _step_sets(self) -> dict[int, frozenset[int]]:
        return {rank: frozenset(flushed) for rank, (flushed, _) in self._steps_by_rank.items()}

    @property
    def steps(self) -> list[int]:
        """Every step flushed on at least one rank."""
        return sorted({s for flushed, _ in self._steps_by_rank.values() for s in flushed})

    def steps_of(self, rank: int) -> list[int]:
        """The steps flushed on one rank."""
        return list(self._steps_by_rank.get(rank, ([], []))[0])

    def has_step(self, step: int, rank: int) -> bool:
        """Whether rank ``rank`` flushed step ``step``."""
        return step in self._step_sets.get(rank, ())

    @property
    def unfinished_steps(self) -> list[tuple[int, int]]:
        """(step, rank) pairs whose flush never finished (the process died while writing)."""
        return sorted(
            (s, r) for r, (_, unfinished) in self._steps_by_rank.items() for s in unfinished
        )

    def damaged_steps(self) -> list[DamagedStep]:
        """The flushed steps that cannot be read, with the reason (a damaged or missing file,
        records that disagree with each other), by rank then step. Reads every step whole (its
        manifest, op records and every mode's files), once per Run: the other steps read as usual,
        and the run-wide readers (:meth:`checks`, :meth:`monitor`, :meth:`anomalies`,
        :meth:`first_nonfinite`, :meth:`skipped_steps`) pass damaged steps over with a warning."""
        found = []
        for rank in self.ranks:
            for step in self.steps_of(rank):
                reason = self.step_damage(step, rank)
                if reason is not None:
                    found.append(DamagedStep(step, rank, reason))
        return found

    def step_damage(self, step: int, rank: int | None = None) -> str | None:
        """Why one flushed step cannot be read, or None when every file of it reads (see
        :meth:`damaged_steps`)."""
        step, rank = self.resolve(step, rank)
        if (step, rank) not in self._damage:
            try:
                self._read_whole(step, rank)
                self._damage[(step, rank)] = None
            except ProbeError as e:
                self._damage[(step, rank)] = str(e)
        return self._damage[(step, rank)]

    def _read_whole(self, step: int, rank: int) -> None:
        self.step_info(step, rank)
        self.ops(step, rank)  # with every mode's files attached to them (statistics, checks)
        for mode in self.step_info(step, rank).manifest.get("modes", {}):
            files = self.mode_files(mode, step, rank)
            if files is not None:
                files.read_whole()

    def _readable(self, step: int, rank: int, read: Callable[[int, int], V]) -> V | None:
        """``read(step, rank)``, or None with a warning naming the step when it cannot be read: a
        run-wide reader goes on over the other steps (see :meth:`damaged_steps`)."""
        try:
            return read(step, rank)
        except ProbeError as e:
            self._damage[(step, rank)] = str(e)
            warn_once(f"damaged-step:{self.path}:{step}:{rank}",
                      f"{DamagedStep(step, rank, str(e)).describe()}; the other steps are read")
            return None

    def process(self, rank: int) -> dict[str, Any]:
        """What rank ``rank`` recorded about its process (``rank.json``): world size, backend,
        host, pid, device; empty for runs written before it existed."""
        path = layout.rank_dir(self.path, rank) / layout.RANK_FILE
        return read_json(path, run=self.path) if path.exists() else {}

    def step_info(self, step: int, rank: int = 0) -> StepInfo:
        """The manifest of one flushed step: complete or not, why, and what each mode wrote."""
        return self._step_info(_Place(step, rank))

    def _load_step_info(self, place: _Place) -> StepInfo:
        path = place.directory(self.path) / layout.MANIFEST_FILE
        manifest = read_json(path, run=self.path)
        _check_version(path, manifest.get("format_version"))
        with reading(path):
            complete = expect(manifest.get("complete"), bool, "complete")
            reason = expect(manifest.get("reason"), (str, type(None)), "reason")
            modes = expect(manifest.get("modes", {}), dict, "modes")
            if place.tail and manifest.get("tail") is not True:
                raise ValueError("a tail's manifest must say \"tail\": true")
        registered = registered_mode_files()
        for name in sorted(set(modes) - set(registered)):
            warn_once(f"unknown-mode-{name}", f"{str(path)!r} lists mode {name!r}, which this probe does not "
                      "know (written by a newer probe, or a plug-in not imported?): reading the step "
                      "without its files")
        return StepInfo(place.step, place.rank, complete, reason, manifest)

    # -- the modes' files ------------------------------------------------------------

    def mode(self, name: str) -> ModeReader:
        """The reader of mode ``name`` over this run: the class its step reader names as
        ``run_reader`` (``run.mode("monitor").series(step, rank)``, ``.anomalies()``;
        ``run.mode("free_benchmark").checks()``), else a :class:`ModeReader` (``.files(step,
        rank)``: the mode's reader of one step). Any registered mode may be named, a plug-in's too;
        another name is a :class:`ProbeError` listing them."""
        if name not in self._readers:
            registered = registered_mode_files()
            if name not in registered:
                raise ProbeError(f"no mode {name!r} to read: the registered modes are "
                                 f"{', '.join(sorted(registered))} (a plug-in's module must be imported)")
            files = registered[name]
            self._readers[name] = (ModeReader if files is None else files.run_reader)(self, name)
        return self._readers[name]

    def across_steps(self, read: Callable[[int, int], list[V]], by_step: bool = False) -> list[V]:
        """``read(step, rank)`` of every flushed step of every rank, joined: rank then step, or
        step then rank with ``by_step``. A damaged step is passed over with a warning (see
        :meth:`damaged_steps`)."""
        if by_step:
            places = [(s, r) for s in self.steps for r in self.ranks if self.has_step(s, r)]
        else:
            places = [(s, r) for r in self.ranks for s in self.steps_of(r)]
        return [item for s, r in places for item in self._readable(s, r, read) or []]

    def mode_files(self, mode: str, step: int | None = None, rank: int | None = None) -> ModeFiles | None:
        """The reader of mode ``mode``'s files of one step (the class its plug-in names as
        ``files``), or None when the step's manifest does not list the mode, the mode is not
        registered, or it writes no files."""
        return self._mode_files(_Place(*self.resolve(step, rank)), mode)

    def _mode_files(self, place: _Place, mode: str) -> ModeFiles | None:
        readers = self._files(place)
        if mode not in readers:
            readers[mode] = None
            summary = self._step_info(place).manifest.get("modes", {}).get(mode)
            files = registered_mode_files().get(mode)
            if summary is not None and files is not None:
                where = StepFiles(self.path, place.rank, place.step, place.directory(self.path),
                                  summary if isinstance(summary, dict) else {},
                                  lambda: len(self._lines(place)),
                                  lambda index: self.ops_at([index], place.step, place.rank)[0])
                readers[mode] = files(where)
        return readers[mode]

    # -- records -----------------------------------------------------------------

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        """Op records of one step and rank in execution order (default: first step, rank 0)."""
        return self._ops(_Place(*self.resolve(step, rank)))

    def iter_ops(self, step: int | None = None, rank: int | None = None) -> Iterator[OpRecord]:
        """The records :meth:`ops` returns, one at a time, decoded :data:`OPS_BATCH` at a time and
        not kept: reading a step of any size this way holds one batch of records (and the step's
        line index, 16 bytes an op), where :meth:`ops` holds them all."""
        place = _Place(*self.resolve(step, rank))
        cached = self._ops.peek(place)
        if cached is not None:
            yield from cached
            return
        count = len(self._lines(place))
        # A step of no records is decoded too: its modes' files are checked against it.
        for start in range(0, count, OPS_BATCH) if count else [0]:
            batch = range(start, min(count, start + OPS_BATCH))
            records = self._decode_ops(place, batch)
            for number in batch:
                yield records[number]

    def op_count(self, step: int | None = None, rank: int | None = None) -> int:
        """How many op records one step holds, counted without decoding them (its line index)."""
        return len(self._lines(_Place(*self.resolve(step, rank))))

    def tail(self, rank: int | None = None) -> list[OpRecord] | None:
        """The op records of the rank's tail (the ops after the last ``session.step()`` of a
        session that ended normally, ``rankR/tailN/``; numbered as step N, which is not among
        :attr:`steps`), or None when the rank has none."""
        place = self._tail_place(rank)
        return None if place is None else self._ops(place)

    def _tail_place(self, rank: int | None) -> _Place | None:
        rank = self.resolve(None, rank)[1] if rank is None else rank
        if rank not in self._steps_by_rank:
            raise ProbeError(f"rank {rank} is not in {str(self.path)!r}; ranks: {self.ranks}")
        with reading(layout.rank_dir(self.path, rank)):
            tails = layout.list_tails(self.path, rank)
        return _Place(tails[-1], rank, tail=True) if tails else None

    def write_failures(self, rank: int | None = None) -> list[WriteFailure]:
        """The steps (and tails) whose files could not be written, in the order they failed
        (``rankR/write_failures.jsonl``; every rank when ``rank`` is None). Each was given up:
        its ``.stepN.partial`` directory stays, emptied."""
        found = []
        for r in self.ranks if rank is None else [rank]:
            path = layout.rank_dir(self.path, r) / layout.WRITE_FAILURES_FILE
            rows = read_jsonl(path, run=self.path)
            with reading(path):
                found += [record_from_row(WriteFailure, row, rank=r) for row in rows]
        return found

    def op(self, op_id: str, step: int | None = None, rank: int | None = None) -> OpRecord:
        """The record of ``op_id`` (default: the first step and rank). Found through an index of
        the step's op ids (made once a step, 16 bytes an op), decoding only that op and the
        producers of its inputs: looking up many ops of a step (a replay of each) is linear."""
        place = _Place(*self.resolve(step, rank))
        candidates = self._lines(place).numbers_of_id(op_id)
        for record in self.ops_at(candidates, place.step, place.rank) if candidates else []:
            if record.id == op_id:
                return record
        raise ProbeError(f"no op {op_id!r} in step {place.step} rank {place.rank} of {str(self.path)!r}")

    def graph(
        self, step: int | None = None, rank: int | None = None, phases: Collection[str] | None = None
    ) -> nx.DiGraph:
        """The step's op graph: nodes keyed by op id, edges producer -> consumer.

        ``phases`` (e.g. ``["forward"]``) keeps only the ops of those phases.
        """
        return build_graph(self.iter_ops(step, rank), phases)

    # Aliases of run.mode(...) kept from before it (docs/api: run.checks(), run.monitor(),
    # run.anomalies()); the records are the modes' own (CheckRecord, MonitorRecord, AnomalyRecord).

    def checks(self, step: int | None = None, rank: int | None = None) -> list[Any]:
        """Free-benchmark checks (``CheckRecord``), in execution order (every step and rank when
        not given): ``run.mode("free_benchmark").checks(step, rank)``."""
        return cast("Any", self.mode("free_benchmark")).checks(step, rank)

    def monitor(self, step: int | None = None, rank: int | None = None) -> list[Any]:
        """The monitor's series (``MonitorRecord``), per step in collection order (every step and
        rank when not given): ``run.mode("monitor").series(step, rank)``."""
        return cast("Any", self.mode("monitor")).series(step, rank)

    def anomalies(self) -> list[Any]:
        """The monitor's alerts (``AnomalyRecord``), in step order, then rank, then detection
        order: ``run.mode("monitor").anomalies()``."""
        return cast("Any", self.mode("monitor")).anomalies()

    def anomalies_of(self, step: int, rank: int) -> list[Any]:
        """The monitor's alerts of one step and rank, in detection order:
        ``run.mode("monitor").anomalies(step, rank)``."""
        return cast("Any", self.mode("monitor")).anomalies(step, rank)

    def module_types(self, step: int | None = None, rank: int | None = None) -> dict[str, str]:
        """Module FQN -> class name for the modules of one step."""
        path = _Place(*self.resolve(step, rank)).directory(self.path) / layout.MODULES_FILE
        if not path.exists():
            return {}
        types = read_json(path, run=self.path)
        with reading(path):
            for name, kind in types.items():
                expect(kind, str, f"the class of module {name!r}")
        return types

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        """Whether the step holds a dump: ``run.mode("dump").has_dump(step, rank)``."""
        return cast("Any", self.mode("dump")).has_dump(step, rank)

    def dump(self, step: int | None = None, rank: int | None = None) -> Any:
        """The dump index of one step (``DumpIndex``): ``run.mode("dump").dump(step, rank)``."""
        return cast("Any", self.mode("dump")).dump(step, rank)

    def tensor(
        self, op_id: str, io: str = "output", index: int = 0,
        step: int | None = None, rank: int | None = None,
    ) -> torch.Tensor:
        """A dumped tensor, memory-mapped: ``io`` is "input" or "output", ``index`` its position
        (``run.mode("dump").tensor(...)``)."""
        return cast("Any", self.mode("dump")).tensor(op_id, io, index, step, rank)

    def first_nonfinite(self, step: int | None = None, rank: int | None = None,
                        handled: bool = False) -> OpRecord | None:
        """The earliest op where a non-finite fault starts, or None.

        A NaN or Inf is a fault when it reaches the loss, a gradient, a parameter or a result
        (see :func:`probe.rundir.nonfinite_origins.nonfinite_origins_in`): an ``-inf`` mask that softmax
        absorbs is not one. "Earliest" is execution order within a step (forward before the
        backward of the same step), the earliest step first. Over the ranks of a multi-rank run
        (``rank`` None), the op of the rank where the fault started, before the collective that
        spread it (``bad.rank``; the lowest rank when several are tied: see
        :meth:`first_nonfinite_ranks`). Ops without statistics are not considered.

        A gradient overflow the loss scaler handled (a step ``GradScaler`` skipped, see
        :meth:`skipped_steps`) is no fault: its step is passed over unless ``handled`` is True.
        """
        if rank is None and len(self.ranks) > 1:
            origin = self.first_nonfinite_ranks(step, handled)
            return None if origin is None else origin.ops[0]
        for s in self.steps if step is None else [step]:
            for r in self.ranks if rank is None else [rank]:
                if not self.has_step(s, r):
                    continue
                # Every step when none is named: a damaged one is passed over (said in a warning).
                ops = self.ops(s, r) if step is not None else self._readable(s, r, self.ops)
                origins = nonfinite_origins_in(ops or [])
                if origins and (handled or not handled_by_scaler(origins, self.loss_scaler(s, r))):
                    return origins[0]
        return None

    def loss_scaler(self, step: int | None = None, rank: int | None = None) -> ScalerStep | None:
        """What ``torch.amp.GradScaler`` did in one step: whether the gradients overflowed (it then
        skipped the optimizer step), the scale in force and the next one, and which ops were its
        own (see :mod:`probe.rundir.loss_scaler`): from its ops (stats mode), else from the
        monitor's series (``scaler=``). None when the step recorded neither."""
        place = _Place(*self.resolve(step, rank))
        cached = self._ops.peek(place)
        if cached is not None:
            found = scaler_step_in(cached)
        else:
            # The scaler's few ops found by name in the raw records (op #i is line i), only those decoded.
            candidates = self._lines(place).numbers_holding(SCALER_OP_PREFIX)
            found = None if not candidates else scaler_step(
                place.step, place.rank, self.ops_at(candidates, place.step, place.rank),
                lambda i: self.ops_at([i], place.step, place.rank)[0])
        if found is None:  # a mode that recorded the scaler itself (the monitor's scaler= series)
            found = next((scaler for files in self._step_mode_files(place)
                          if (scaler := files.loss_scaler()) is not None), None)
        return found

    def outputs_nonfinite(self, step: int | None = None, rank: int | None = None) -> bool | None:
        """Whether an op output of one step held a NaN or Inf, read without decoding the op
        records, from the first of the step's modes whose records say (the stats mode's table);
        None when none does (then no op of the step has statistics to be a non-finite origin)."""
        place = _Place(*self.resolve(step, rank))
        return next((held for files in self._step_mode_files(place)
                     if (held := files.outputs_nonfinite()) is not None), None)

    def _step_mode_files(self, place: _Place) -> list[ModeFiles]:
        """The readers of the files of each mode the step's manifest lists, in its order."""
        modes = self._step_info(place).manifest.get("modes", {})
        return [files for mode in modes if (files := self._mode_files(place, mode)) is not None]

    def skipped_steps(self, rank: int | None = None) -> list[ScalerStep]:
        """The steps the loss scaler skipped (their gradients overflowed), by step then rank
        (every rank when ``rank`` is None); each says at which scale (``.scale``, ``.describe()``:
        "step N skipped by the loss scaler: gradients overflowed at scale S"). Known from the
        stats mode's records of the scaler's ops, or from the monitor's series (``scaler=``)."""
        found = []
        for step in self.steps:
            for r in self.ranks if rank is None else [rank]:
                if not self.has_step(step, r):
                    continue
                # An overflow leaves Inf or NaN in the gradients the scaler unscaled: without one,
                # the step was not skipped, and nothing is decoded.
                if self._readable(step, r, self.outputs_nonfinite) is False:
                    continue
                scaler = self._readable(step, r, self.loss_scaler)
                if scaler is not None and scaler.skipped:
                    found.append(scaler)
        return found

    def first_nonfinite_ranks(self, step: int | None = None, handled: bool = False) -> RankOrigin | None:
        """Where a non-finite fault started over the ranks (in ``step`` when given), or None.

        Each rank's first non-finite op (of the earliest step with one) is placed on the
        collective clock: how many collectives the rank had completed in that step. A NaN that
        one rank sends through an all-reduce appears on the others at that collective, later on
        the clock, so the rank with the lowest (step, clock) is where it started; ranks tied
        there are all named. ``.ranks``, ``.ops`` (one per origin rank), ``.step``, ``.clock``,
        ``.later`` (the other ranks' first non-finite ops), ``.describe()``: see
        :mod:`probe.rundir.rank_origin`. Overflows the loss scaler handled are passed over
        unless ``handled`` is True (see :meth:`first_nonfinite`).
        """
        return rank_origin(self, step, handled)

    def nonfinite_origins(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        """Every op of one step where a non-finite fault starts, in execution order (the first
        is :meth:`first_nonfinite` of the step)."""
        return nonfinite_origins_in(self.ops(step, rank))

    def nonfinite_parameters(self, step: int | None = None, rank: int | None = None) -> Any:
        """The parameters that held NaN or Inf at the step's start and the gradients that did
        before its optimizer step, by name (stats mode with ``model=``; ``NonfiniteParameterRecord``),
        or None without statistics: ``run.mode("stats").nonfinite_parameters(step, rank)``."""
        return cast("Any", self.mode("stats")).nonfinite_parameters(step, rank)

    # -- loading -------------------------------------------------------------------

    def resolve(self, step: int | None, rank: int | None) -> tuple[int, int]:
        """The (step, rank) that ``step``, ``rank`` name: the first of each when None.

        Raises :class:`ProbeError` naming what the run holds when either is absent.
        """
        if rank is None:
            if not self.ranks:
                raise ProbeError(f"{str(self.path)!r} holds no rank directories")
            rank = self.ranks[0]
        flushed = self._steps_by_rank.get(rank)
        if flushed is None:
            raise ProbeError(f"rank {rank} is not in {str(self.path)!r}; ranks: {self.ranks}")
        if step is None:
            if not flushed[0]:
                raise ProbeError(f"rank {rank} of {str(self.path)!r} holds no flushed step")
            step = flushed[0][0]
        if step not in flushed[0]:
            raise ProbeError(
                f"step {step} of rank {rank} is not in {str(self.path)!r}; steps: {flushed[0]}"
            )
        return step, rank

    def _load_ops(self, place: _Place) -> list[OpRecord]:
        return list(self._decode_ops(place, None).values())

    def _index_op_lines(self, place: _Place) -> OpLines:
        """``ops.jsonl`` of a step, indexed by line (op #i is line i, blank lines aside)."""
        return OpLines(place.directory(self.path) / layout.OPS_FILE, self.path, OP_LINE_LIMIT)

    def _load_call_sites(self, place: _Place) -> CallSiteTable | None:
        """A step's call sites, read once however many of its ops are decoded, and however often."""
        path = place.directory(self.path) / layout.CALLSITES_FILE
        return CallSiteTable(path, self.path) if path.exists() else None

    def _decode_ops(self, place: _Place, only: Collection[int] | None) -> dict[int, OpRecord]:
        """Op #i -> its record with what each mode knows of it attached (statistics): every op,
        or ``only`` these and the producers of their inputs (whose output statistics those
        inputs share)."""
        with collections_paused():
            return self._decode_ops_now(place, only)

    def _decode_ops_now(self, place: _Place, only: Collection[int] | None) -> dict[int, OpRecord]:
        info = self._step_info(place)  # a step is read only under a readable manifest (written last)
        step, rank = place.step, place.rank
        lines = self._lines(place)
        ops_path = lines.path
        sites: CallSiteTable | None = None  # read when a record first names a call site
        sites_read = False
        records: dict[int, OpRecord] = {}
        exact: dict[int, list[bool]] = {}  # per input: shares its producer's statistics row
        policies = _autocast_policies(info.manifest, place.directory(self.path) / layout.MANIFEST_FILE)

        def decode(number: int, text: str) -> OpRecord:
            nonlocal sites, sites_read
            try:
                row = parse_json(text, "the record")
            except READ_ERRORS:
                # The line's name is made only for a line that fails: a context manager and its
                # text for every line were a tenth of a graph export's time.
                with reading(f"{ops_path}, line {number + 1}"):
                    raise
            try:  # decode checks every field and names the one that is wrong
                (index, op_id, name, phase, module, call, stack, ins, outs, site, group, skipped, placed,
                 amp, constants, parameter) = decode_op_record(row)
                autocast = None
                if policies is not None and phase in _POLICY_PHASES:
                    if not 0 <= amp < len(policies):
                        raise ProbeError(f"op record field 'amp': {amp} is not in the manifest's autocast "
                                         f"table of {len(policies)}")
                    autocast = policies[amp]
            except ProbeError as e:
                raise ProbeError(f"cannot read {str(ops_path)!r}, line {number + 1}: {e}") from None
            why = {(io, position): reason for io, position, reason in skipped}
            exact[number] = [bool(src and src[2]) for _, _, src in ins]
            if site is not None and not sites_read:
                sites, sites_read = self._sites(place), True
            return OpRecord(
                index=index,
                id=op_id,
                name=name,
                phase=phase,
                module=module,
                module_call=call,
                module_stack=list(stack),
                step=step,
                rank=rank,
                inputs=[
                    TensorRecord(d, s, source=(src[0], src[1]) if src else None,
                                 skipped=why.get(("in", i)))
                    for i, (d, s, src) in enumerate(ins)
                ],
                outputs=[TensorRecord(d, s, mutated=m, skipped=why.get(("out", i)))
                         for i, (d, s, m) in enumerate(outs)],
                stack=sites.get(site) if site is not None and sites is not None else None,
                group=None if group is None else {"size": group[0], "name": group[1],
                                                  "ranks": list(group[2])},
                layout=None if placed is None else encode_layout(placed),
                autocast=autocast,
                constants=dict(constants),
                parameter=parameter,
            )

        wanted = range(len(lines)) if only is None else sorted(set(only))
        if wanted and not (wanted[0] >= 0 and wanted[-1] < len(lines)):
            missing = wanted[0] if wanted[0] < 0 else wanted[-1]
            raise ProbeError(f"{str(ops_path)!r} holds {len(lines)} op records: there is no op #{missing}")
        for number, text in lines.texts(wanted):
            records[number] = decode(number, text)
        if only is not None:
            producers = {t.source[0] for r in list(records.values()) for t in r.inputs if t.source}
            outside = sorted(p for p in producers - set(records) if 0 <= p < len(lines))
            for number, text in lines.texts(outside):
                records[number] = decode(number, text)
        with reading(ops_path):
            _check_references(records)
        for mode in info.manifest.get("modes", {}):
            files = self._mode_files(place, mode)
            if files is not None:
                files.attach(records)
        # Inputs without their own row share their exact producer's output row.
        for number, record in records.items():
            for tensor, shares in zip(record.inputs, exact[number], strict=True):
                if tensor.stats is None and shares and tensor.source and tensor.source[0] in records:
                    produced = records[tensor.source[0]].outputs[tensor.source[1]]
                    tensor.stats = produced.stats
                    tensor.distribution, tensor.histogram = produced.distribution, produced.histogram
        return dict(sorted(records.items())) if only is not None else records

    def ops_at(self, indices: Collection[int], step: int | None = None, rank: int | None = None
               ) -> list[OpRecord]:
        """The records of ops #``indices`` of a step, decoding only those (and the producers of
        their inputs, for their statistics): for scans of long runs that need a few ops a step."""
        place = _Place(*self.resolve(step, rank))
        cached = self._ops.peek(place)
        if cached is not None:
            if any(not 0 <= i < len(cached) for i in indices):
                raise ProbeError(f"step {place.step} rank {place.rank} holds {len(cached)} ops: "
                                 f"no op #{max(indices)}")
            return [cached[i] for i in indices]
        records = self._decode_ops(place, indices)
        return [records[i] for i in indices]

    def output_stats(self, step: int | None = None, rank: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """The stats mode's rows of one step's op outputs, without decoding the op records:
        ``(op index per row, rows)``, or None when the step has no statistics
        (``run.mode("stats").output_stats(step, rank)``)."""
        return cast("Any", self.mode("stats")).output_stats(step, rank)


@contextmanager
def collections_paused() -> Iterator[None]:
    """Python's cyclic collector off while a step's records are decoded (or, by a reader of the
    whole step such as the graph export, while they are used). Decoding makes tens of
    containers an op (records, tensor lists, statistics dicts), none in a cycle, all alive until
    the batch is handed over: the collector walked them again and again as they were promoted,
    a third of the time of a graph export. A program that turned the collector off keeps it off;
    what others make meanwhile is collected once it is back on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def load(path: str | Path) -> Run:
    """Open a run directory written by ``probe.mode(..., out=path)``."""
    return Run(path)


def _check_references(records: dict[int, OpRecord]) -> None:
    """Op #i has index i, and an input's source is an output of an earlier op."""
    for number, record in records.items():
        if record.index != number:
            raise ValueError(f"op record {number} has index {record.index}")
        for tensor in record.inputs:
            if tensor.source is None:
                continue
            producer, output = tensor.source
            known = records.get(producer)
            if not (0 <= producer < number and (known is None or 0 <= output < len(known.outputs))):
                raise ValueError(f"op #{number} reads output {output} of op #{producer}, "
                                 "which is not an earlier op's output")

