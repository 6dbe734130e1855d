"""A probe session: the context manager ``probe.mode(...)`` returns.

It owns the tracer, the modes and the run writer, and drives the step cycle:
``step()`` ends the current step and starts the next. The ended step's records
are handed to a writer thread (``async_flush=True``, the default), which
encodes them, moves statistics to the host and commits the step directory
while the next step runs; at most one step is in flight, so when ``step()``
returns every earlier step is on disk. Leaving the ``with`` block flushes what
the last step recorded and waits for the writer; if the block raised, that step
is written too, marked incomplete, so the ops leading up to a crash are kept.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from probe import __version__
from probe.errors import ProbeError
from probe.modes.base import Mode, StepResult
from probe.modes.registry import MODES, mode_option_names
from probe.npu import read_and_clear_overflow_flag
from probe.options import Options, parse_options
from probe.rundir import layout
from probe.rundir.background import BackgroundWriter
from probe.rundir.op_records import encode
from probe.rundir.writer import RunWriter
from probe.tracer.compat import check_dispatch_features, compiled_regions_eager
from probe.tracer.dispatch_mode import ProbeDispatchMode, Tracer
from probe.tracer.op_call import RECORD_CALLSITE, RECORD_PHASE, OpRecordTuple
from probe.tracer.rank import current_rank, process_info

_active: Session | None = None


def default_out_dir() -> Path:
    return Path("probe_runs") / time.strftime(f"run-%Y%m%d-%H%M%S-{os.getpid()}")


def _build_modes(options: Options) -> list[Mode]:
    modes = []
    for name in options.modes:
        cls = MODES[name]
        kwargs = {k: v for k, v in options.mode_options.items() if k in cls.option_names}
        modes.append(cls(**kwargs))
    replacing = [m.name for m in modes if m.replaces_execution]
    if len(replacing) > 1:
        raise ProbeError(f"modes {replacing} each replace op execution; combine at most one of them")
    return modes


def _options_summary(options: Options) -> dict[str, Any]:
    def listed(values: Any) -> Any:
        return None if values is None else sorted(values)

    return {
        "ops": listed(options.ops.globs),
        "modules": listed(options.modules.globs),
        "steps": listed(options.steps.values),
        "ranks": listed(options.ranks.values),
        "phases": sorted(options.phases),
        "stack": options.stack,
        "compiled": options.compiled,
        "async_flush": options.async_flush,
        "mode_options": {k: repr(v) for k, v in options.mode_options.items()},
    }


class Session:
    """Returned by :func:`probe.mode`; use it as a context manager and call :meth:`step`."""

    def __init__(self, modes: Any = None, **kwargs: Any) -> None:
        self.options = parse_options(modes, kwargs, mode_option_names())
        self.modes = _build_modes(self.options)
        self.out = self.options.out if self.options.out is not None else default_out_dir()
        self.step_index = 0
        self._tracer: Tracer | None = None
        self._writer: RunWriter | None = None
        self._background: BackgroundWriter | None = None
        self._exit_stack: ExitStack | None = None
        self._stopped_between_steps = False

    # -- context ---------------------------------------------------------------

    def __enter__(self) -> Session:
        global _active
        if _active is not None:
            raise ProbeError("a probe session is already active; nest none inside another")
        check_dispatch_features()
        process = process_info()
        rank = process["rank"]
        self._check_collectives_on_every_rank(process["world_size"])
        tracer = Tracer(self.options, self.modes, rank)
        if rank in self.options.ranks:
            self._writer = RunWriter(
                self.out,
                process,
                self.options.overwrite,
                {
                    "probe_version": __version__,
                    "modes": list(self.options.modes),
                    "options": _options_summary(self.options),
                },
            )
        stack = ExitStack()
        try:
            if self._writer is not None:
                for mode in self.modes:
                    mode.start(self.out, rank)
                    mode.attach(self.options.model, self.out, rank)
        except BaseException:
            for mode in self.modes:
                mode.close()
            raise
        if self._writer is not None and self.options.async_flush:
            self._background = BackgroundWriter(max_pending=1)
            stack.callback(self._background.close)
        # An unselected rank runs its steps untraced: no dispatch mode, no hooks.
        if self._writer is not None and any(mode.needs_ops for mode in self.modes):
            tracer.modules.install()
            stack.callback(tracer.modules.uninstall)
            stack.enter_context(compiled_regions_eager(self.options.compiled))
            stack.enter_context(ProbeDispatchMode(tracer))
        self._tracer, self._exit_stack = tracer, stack
        _active = self
        self._begin_step(rank)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _active
        tracer, stack = self._tracer, self._exit_stack
        assert tracer is not None and stack is not None
        try:
            raised_in_step = exc is not None and not self._stopped_between_steps
            if tracer.records or raised_in_step or any(mode.has_pending() for mode in self.modes):
                reason = None if exc is None else f"{type(exc).__name__}: {exc}"
                self._flush(complete=exc is None, reason=reason)
        finally:
            try:
                stack.close()  # waits for the writer thread
            finally:
                self._background = None
                for mode in self.modes:
                    mode.close()
                _active = None
                self._tracer = self._exit_stack = None

    def _check_collectives_on_every_rank(self, world: int) -> None:
        """A mode that reduces across ranks each step would hang the job if only some ranks ran it."""
        ranks = self.options.ranks.values
        if world <= 1 or ranks is None or set(range(world)) <= ranks:
            return
        for mode in self.modes:
            if mode.collective_each_step:
                raise ProbeError(
                    f"mode {mode.name!r} reduces across ranks every step, but option 'ranks' selects "
                    f"{sorted(ranks)} of {world}: the other ranks would never join it; select every rank "
                    "or turn the reduction off"
                )

    # -- steps -----------------------------------------------------------------

    def step(self) -> None:
        """End the current step: flush it to the run directory and start the next."""
        if self._tracer is None:
            raise ProbeError("session.step() called outside the session's with block")
        self._flush(complete=True, reason=None)
        self.step_index += 1
        self._begin_step(current_rank())
        try:
            for mode in self.modes:
                mode.after_step()
        except BaseException:
            self._stopped_between_steps = True  # the next step has not run: nothing to write
            raise

    def _begin_step(self, rank: int) -> None:
        assert self._tracer is not None
        self._tracer.begin_step(self.step_index, rank)
        for mode in self.modes:
            mode.begin_step(self.step_index)
        self._step_started = time.perf_counter()

    def _flush(self, complete: bool, reason: str | None) -> None:
        """End the tracer's step and have it written (on the writer thread if any)."""
        tracer = self._tracer
        assert tracer is not None
        step = tracer.step
        with tracer.paused():
            records = tracer.end_step(wait=complete)
            ended = [(mode, mode.end_step(step)) for mode in self.modes]
            results = [(mode.name, result) for mode, result in ended]
            # Per-op modes have nothing without op records; hook-based ones say so themselves.
            collected = any(result is not None for mode, result in ended if not mode.needs_ops)
            if self._writer is None or not (records or collected or not complete):
                return
            types = tracer.modules.names.types
            module_types = {fqn: types[fqn] for fqn in {r[4] for r in records} if fqn in types}
            sites = tracer.call_sites
            used_sites = (
                {i: sites.stacks[i] for i in {r[RECORD_CALLSITE] for r in records} if i is not None}
                if sites is not None
                else None
            )
            manifest = {
                "complete": complete,
                "reason": reason,
                "ops": len(records),
                "phases": dict(Counter(r[RECORD_PHASE] for r in records)),
                "seconds": round(time.perf_counter() - self._step_started, 6),
                "torch_version": torch.__version__,
            }
            if tracer.modules.names.parallel is not None:
                manifest["parallel"] = tracer.modules.names.parallel
            npu_overflow = read_and_clear_overflow_flag()
            if npu_overflow is not None:
                manifest["npu_overflow"] = npu_overflow

            def write() -> None:
                self._write_step(step, records, results, used_sites, module_types, manifest)

            if self._background is not None:
                self._background.submit(write)
                if not complete:  # the block is raising: be on disk before it propagates
                    self._background.drain()
            else:
                write()

    def _write_step(
        self,
        step: int,
        records: list[OpRecordTuple],
        results: list[tuple[str, StepResult | None]],
        sites: dict[int, list[str]] | None,
        module_types: dict[str, str],
        manifest: dict[str, Any],
    ) -> None:
        assert self._writer is not None
        writer = self._writer.step(step)
        writer.write_jsonl(layout.OPS_FILE, (encode(r) for r in records))
        writer.write_json(layout.MODULES_FILE, module_types)
        if sites is not None:
            writer.write_json(layout.CALLSITES_FILE, {str(i): stack for i, stack in sorted(sites.items())})
        modes = {name: result.write(writer) for name, result in results if result is not None}
        writer.commit({**manifest, "modes": modes})


def mode(modes: Any = None, **options: Any) -> Session:
    """Trace every aten op under one or more modes; see API.md for the options.

    >>> with probe.mode("stats", out="runs/a") as session:
    ...     loss = model(batch); loss.backward(); opt.step()
    ...     session.step()
    """
    return Session(modes, **options)
