"""The session's writer: each ended step's files, written on a writer thread (``async_flush``) or
in place, and the failures it gave up on, said once.

The session (``probe/session.py``) hands over a step as plain data (:meth:`SessionWriter.step_job`:
the tracer's records and manifest entries, each plug-in's result) while the tracer and the modes
let go of it; the write itself (:meth:`SessionWriter.hand_over`) runs on the writer thread, at
most one step in flight, so when ``step()`` returns every earlier step is on disk.

The op records are encoded to JSON here, on the training thread, and only their bytes handed
over: encoding holds the GIL, which the training thread gives up at each torch call, so on the
writer thread it delayed the step by more than its own time (H200, HF Llama at 7B width: a stats
step 90 ms with all of the write on the writer thread, 84 ms with all of it in place;
``benchmarks/cuda_profile.py``'s writer table). The writer thread keeps what waits: the device's
copies of the modes' results, file writes and fsyncs. A step whose
files cannot be written is recorded in the run and given up (one warning), never raised, unless
a mode's result asks for write failures to stop training."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError, warn_once
from probe.modes.base import SessionPlugin, StepResult
from probe.npu import read_and_clear_overflow_flag
from probe.rundir import layout
from probe.rundir.background import BackgroundWriter
from probe.rundir.op_record_fields import (
    RECORD_AUTOCAST,
    RECORD_CALLSITE,
    RECORD_MODULE,
    RECORD_PHASE,
    OpRecordTuple,
)
from probe.rundir.op_record_json import encode
from probe.rundir.writer import RunWriter, jsonl_chunks
from probe.tracer.dispatch_mode import Tracer
from probe.tracer.mode_stack import untraced


@dataclass(frozen=True)
class StepContext:
    """What the session knows of an ended step besides the tracer: its manifest's own entries."""

    started: float
    """``time.perf_counter()`` when the step began."""
    kind: str | None
    """``Session.step_kind`` (``"evaluation"``), or None for a training step."""
    links: Callable[[int], dict[str, Any]]
    """The escalation's entries of a step that is written (traced because of an anomaly, or not
    for the trace limit); asked only then, since asking takes the refusals it reports."""
    compiled_eager: int
    """Compiled regions entered and run eagerly in the step (``compiled="eager"``)."""


class SessionWriter:
    """Writes a session's steps into its rank's run directory; writes nothing on a rank the
    session does not record (:attr:`run` is None there)."""

    def __init__(self) -> None:
        self.run: RunWriter | None = None
        self._background: BackgroundWriter | None = None

    def open(self, out: Path, process: dict[str, Any], overwrite: bool, run_fields: dict[str, Any]) -> None:
        """Lock the rank directory and write its first files: an unwritable directory is a
        ``ProbeError`` here, before anything is traced."""
        self.run = RunWriter(out, process, overwrite, run_fields)

    def start_thread(self, stack: ExitStack) -> None:
        """Write steps on a writer thread from now on, until ``stack`` closes (waiting for it)."""
        background = self._background = BackgroundWriter(max_pending=1)

        def close() -> None:
            self._background = None
            background.close()

        stack.callback(close)

    def drain(self) -> None:
        """Until every ended step is on disk."""
        if self._background is not None:
            self._background.drain()

    def close(self) -> None:
        """Free the rank's lock (after the writer thread stopped)."""
        run, self.run = self.run, None
        if run is not None:
            run.close()

    def abandon_in_forked_child(self) -> None:
        """In a forked child: drop the writer unused (its thread was not forked)."""
        run, self.run = self.run, None
        self._background = None
        if run is not None:
            run.abandon_in_forked_child()

    def step_job(
        self,
        step: int,
        tail: bool,
        tracer: Tracer,
        records: list[OpRecordTuple],
        ended: list[tuple[SessionPlugin, StepResult | None]],
        complete: bool,
        reason: str | None,
        context: StepContext,
    ) -> Callable[[], None] | None:
        """The write of one ended step as plain data, or None when there is nothing to write."""
        results = [(mode.name, result) for mode, result in ended]
        # Per-op modes have nothing without op records; hook-based ones say so themselves (a plug-in
        # the session added on its own, the checksums of model=, only adds to steps written anyway).
        collected = any(result is not None for mode, result in ended
                        if mode.observer() is None and not mode.implicit)
        # Ops that ran on a thread the dispatch mode does not see: said in the manifest, even
        # of a step that recorded none (training in a threading.Thread).
        untraced_calls = dict(tracer.modules.untraced_calls)
        if self.run is None or not (records or collected or untraced_calls or not complete):
            return None
        types = tracer.modules.names.types
        module_types = {fqn: types[fqn] for fqn in {r[RECORD_MODULE] for r in records} if fqn in types}
        sites = tracer.call_sites
        used_sites = (
            {i: sites.stacks[i] for i in {r[RECORD_CALLSITE] for r in records} if i is not None}
            if sites is not None
            else None
        )
        manifest: dict[str, Any] = {
            "complete": complete,
            "reason": reason,
            "ops": len(records),
            # (map, not a generator: a generator's every step is a Python call, one per op.)
            "phases": dict(Counter(map(itemgetter(RECORD_PHASE), records))),
            "seconds": round(time.perf_counter() - context.started, 6),
            "torch_version": torch.__version__,
        }
        if tail:
            manifest["tail"] = True
        else:
            # Traced because of an anomaly, or not for the trace limit: the links probe summary reads.
            manifest.update(context.links(step))
        if not tail and context.kind is not None:
            manifest["kind"] = context.kind
        if tracer.modules.names.parallel is not None:
            manifest["parallel"] = tracer.modules.names.parallel
        if context.compiled_eager:
            manifest[layout.COMPILED_EAGER_KEY] = context.compiled_eager
        if untraced_calls:
            manifest[layout.UNTRACED_THREADS_KEY] = untraced_calls
        if tracer.mode_failures:
            manifest[layout.MODE_FAILURES_KEY] = dict(tracer.mode_failures)
        used_policies = {r[RECORD_AUTOCAST] for r in records}
        manifest[layout.AUTOCAST_KEY] = tracer.modules.policies.manifest(used_policies)
        if tracer.opened_regions:
            manifest[layout.COMPILED_OPENED_KEY] = {op_id: [start, end] for op_id, start, end
                                                    in tracer.opened_regions}
        if tracer.region_files is not None and (region_files := tracer.region_files.take(step)):
            manifest[layout.COMPILED_FILES_KEY] = region_files
        npu_overflow = read_and_clear_overflow_flag()
        if npu_overflow is not None:
            manifest["npu_overflow"] = npu_overflow

        # (The records' bytes only, not the records: the write holds the smaller of the two.)
        ops, op_count = list(jsonl_chunks(map(encode, records))), len(records)

        def write() -> None:
            self._write_step(step, tail, ops, op_count, results, used_sites, module_types, manifest)

        return write

    def hand_over(self, job: Callable[[], None], wait: bool) -> None:
        """Run ``job`` on the writer thread (in place without one); ``wait``: until it is on disk."""
        if self._background is None:
            with untraced():  # the writer thread has none; here the user's may be on
                job()
            return
        once = _Once(job)
        try:
            self._background.submit(once)
        except BaseException:
            # Interrupted (Ctrl-C) before the job was surely queued: write the step here, after
            # the steps before it, unless the writer thread has taken it; then let it go on.
            with contextlib.suppress(BaseException):
                self._background.drain()
            with contextlib.suppress(BaseException), untraced():
                once()
            raise
        if wait:  # the block is raising: be on disk before it propagates
            self._background.drain()

    def _write_step(
        self,
        step: int,
        tail: bool,
        ops: list[bytes],
        op_count: int,
        results: list[tuple[str, StepResult | None]],
        sites: dict[int, list[str]] | None,
        module_types: dict[str, str],
        manifest: dict[str, Any],
    ) -> None:
        """Write one step (on the writer thread if any). A failed write is recorded in the run
        and given up, never raised: training goes on."""
        run_writer = self.run
        assert run_writer is not None
        try:
            writer = run_writer.step(step, tail)
            writer.write_chunks(layout.OPS_FILE, ops)
            writer.write_json(layout.MODULES_FILE, module_types)
            if sites is not None:
                writer.write_json(layout.CALLSITES_FILE, {str(i): s for i, s in sorted(sites.items())})
            modes = {name: result.write(writer) for name, result in results if result is not None}
            writer.commit({**manifest, "modes": modes})
        except OSError as e:
            failure = run_writer.record_failure(step, tail, e, op_count, [name for name, _ in results])
            # A mode may ask for write failures to stop training (base.StepResult).
            stopping = [name for name, result in results
                        if getattr(result, "stops_training_on_write_failure", False)]
            if stopping:
                raise ProbeError(
                    f"cannot write step {step} ({failure['file']}: {failure['error']}); mode "
                    f"{stopping[0]!r} has on_error='raise'"
                ) from e

    def warn_failures(self) -> None:
        """One warning per run for steps the writer gave up (said on the training thread)."""
        if self.run is None:
            return
        failures = self.run.new_failures()
        if not failures:
            return
        first = failures[0]
        what = f"the tail after step {first['step'] - 1}" if first["tail"] else f"step {first['step']}"
        warn_once(
            f"write-failed:{self.run.rank_path}",
            f"cannot write {what} to {str(self.run.rank_path)!r} ({first['file']}: {first['error']}); "
            f"training goes on; the step is left unfinished ({first['directory']}) and every step given up "
            f"is listed in {layout.WRITE_FAILURES_FILE} there",
        )


class _Once:
    """A step's write, run by whichever thread calls it first (the writer thread, or the training
    thread when handing it over was interrupted); later calls do nothing."""

    def __init__(self, job: Callable[[], None]) -> None:
        self._job: Callable[[], None] | None = job
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            job, self._job = self._job, None
        if job is not None:
            job()
