"""A probe session: the context manager ``probe.mode(...)`` returns.

It is the lifecycle: start, the step cycle, pause, stop, a forked child's copy. Its parts are
collaborators, each in a module of its own: the plug-ins (``probe.session_plugins``: the modes,
made, driven and closed together), the writer (``probe.session_writer``: each ended step's files)
and the escalation (``probe.escalation``: trace modes armed after an anomaly); the tracer sees
the ops. ``step()`` ends the current step and starts the next. The ended step's records
are handed to a writer thread (``async_flush=True``, the default), which
encodes them, moves statistics to the host and commits the step directory
while the next step runs; at most one step is in flight, so when ``step()``
returns every earlier step is on disk. Leaving the ``with`` block flushes what
the last step recorded and waits for the writer; if the block raised, that step
is written too, marked incomplete, so the ops leading up to a crash are kept.
After a normal end, what was recorded after the last ``step()`` (a ``loss.item()``
after the loop) is written as the run's tail, not as a step of its own.

Failures: an unwritable run directory is a ``ProbeError`` at the start; later, a
step whose files cannot be written is given up and named in the run, with one
warning, and training goes on. The user's own exception always wins over the
probe's.

A process forked while a session runs (``os.fork()``, a DataLoader worker) holds a detached
copy of it: it traces and writes nothing, and its ``step()``/``stop()`` return at once (see
:meth:`Session._detach_forked`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

from probe.errors import ProbeError, warn_once
from probe.escalation import Escalation
from probe.lifecycle import traced
from probe.modes.base import SessionPlugin
from probe.options import Options, parse_options, show
from probe.seeding import seeded
from probe.session_plugins import SessionPlugins
from probe.session_writer import SessionWriter, StepContext
from probe.tracer.compat import check_dispatch_features
from probe.tracer.dispatch_mode import Tracer
from probe.tracer.mode_stack import untraced
from probe.tracer.rank import current_rank, process_info
from probe.tracer.region_files import RegionFiles
from probe.version import __version__

_active: Session | None = None


def default_out_dir() -> Path:
    return Path("probe_runs") / time.strftime(f"run-%Y%m%d-%H%M%S-{os.getpid()}")


def _options_summary(options: Options) -> dict[str, Any]:
    def listed(values: Any) -> Any:
        return None if values is None else sorted(values)

    return {
        "ops": listed(options.ops.globs),
        "modules": listed(options.modules.globs),
        "steps": options.steps.to_json(),
        "ranks": options.ranks.to_json(),
        "phases": sorted(options.phases),
        "stack": options.stack,
        "compiled": options.compiled,
        "async_flush": options.async_flush,
        "gc_freeze": options.gc_freeze,
        "mode_options": {k: show(v) for k, v in options.mode_options.items()},
        "mode_configs": {c.mode: {k: show(v) for k, v in c.options.items()} for c in options.mode_configs},
    }


class Session:
    """Returned by :func:`probe.mode`; use it as a context manager and call :meth:`step`."""

    def __init__(self, modes: Any = None, **kwargs: Any) -> None:
        self.options = parse_options(modes, kwargs)
        self._plugins = SessionPlugins(self.options)
        self.modes: list[SessionPlugin] = self._plugins.modes
        # The monitor's on_anomaly="trace": per-op modes armed for a few steps after an anomaly.
        self._escalation = Escalation.of(self.modes, self.options, self._plugins.observers)
        self.out = self.options.out if self.options.out is not None else default_out_dir()
        self.step_index = 0
        self._tracer: Tracer | None = None
        self._writer = SessionWriter()
        self._exit_stack: ExitStack | None = None
        self._stopped_between_steps = False
        self._held: tuple[bool, bool] | None = None
        """While paused: the tracer's (recording, module tracking) to restore on resume()."""
        self._ran = False
        self._compiled_eager = 0
        """Compiled regions entered and run eagerly in the current step (compiled="eager")."""
        self.step_kind: str | None = None
        """What the current step is, written to its manifest as ``"kind"`` (the integrations set
        ``"evaluation"``); None, a training step, writes no field. Reset when a step begins."""
        self._forked_from: int | None = None
        """In a process forked while the session ran: the parent's pid (the session is detached)."""

    # -- context ---------------------------------------------------------------

    def __enter__(self) -> Session:
        global _active
        if self._tracer is not None:
            raise ProbeError(f"the session writing {str(self.out)!r} is already running; a session is "
                             "entered once (with probe.mode(...) as s, or s.start()), not twice")
        if self._ran:
            raise ProbeError(f"the session writing {str(self.out)!r} has stopped and runs once: entering it "
                             "again would add steps to a finished run; create a new one with probe.mode(...) "
                             "(to leave part of training untraced, use session.pause()/resume() or "
                             "session.paused())")
        if _active is not None:
            raise ProbeError(f"a probe session (writing {str(_active.out)!r}) is already active; nest none "
                             "inside another, and stop() one started with start() before the next")
        check_dispatch_features()
        process = process_info()
        rank = process["rank"]
        self._plugins.check_collectives_on_every_rank(process["world_size"], self.options)
        escalated = [self._escalation.observer] if self._escalation is not None else []
        tracer = Tracer(self.options, self._plugins.observers + escalated, rank)
        if self.options.compiled == "keep":
            tracer.region_files = RegionFiles(self.out, rank, self.options.compiled_inputs
                                              or "dump" in self.options.modes)
        if rank in self.options.ranks:
            # Locks the rank directory and writes its first files: an unwritable directory
            # is a ProbeError here, before anything is traced.
            self._writer.open(
                self.out,
                process,
                self.options.overwrite,
                {
                    "probe_version": __version__,
                    "modes": list(self.options.modes),
                    "options": _options_summary(self.options),
                    **({"hparams": self.options.hparams} if self.options.hparams is not None else {}),
                    **({"seed": seed} if (seed := seeded()) is not None else {}),
                },
            )
        stack = ExitStack()
        try:
            writing = self._writer.run is not None
            if writing:
                self._plugins.start(self.options.model, self.out, rank)
            if writing and self.options.async_flush:
                self._writer.start_thread(stack)
            if writing and self._escalation is not None:
                self._escalation.start(tracer, self.out, rank)
                stack.callback(self._escalation.disarm)  # before the writer's close: LIFO
            # An unselected rank runs its steps untraced: no dispatch mode, no hooks.
            if writing and self._plugins.observers:
                traced(stack, tracer, self.options.compiled, self._compiled_ran_eagerly,
                       gc_freeze=self.options.gc_freeze)
        except BaseException:
            # The failure to start is the one to report.
            with contextlib.suppress(BaseException):
                stack.close()
            with contextlib.suppress(BaseException):
                self._close_modes_and_writer()
            raise
        self._tracer, self._exit_stack = tracer, stack
        self._ran = True  # only a start that succeeded counts: after a failed one, start again
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
        if self._forked_from is not None:
            self._stop_forked()
            return
        tracer, stack = self._tracer, self._exit_stack
        assert tracer is not None and stack is not None
        try:
            try:
                raised_in_step = exc is not None and not self._stopped_between_steps
                if (tracer.records or raised_in_step or tracer.modules.untraced_calls
                        or self._plugins.has_pending()):
                    reason = None if exc is None else f"{type(exc).__name__}: {exc}"
                    # After a normal end, what the last step() left behind is a tail, not a step.
                    tail = exc is None and self.step_index > 0
                    self._flush(complete=exc is None, reason=reason, tail=tail)
            finally:
                try:
                    stack.close()  # waits for the writer thread
                finally:
                    self._writer.warn_failures()
                    self._warn_steps_not_reached()
                    self._close_modes_and_writer()
        except BaseException as probe_failure:
            if exc is None:
                raise
            # The user's exception wins: the probe's own failure is said, not raised.
            warn_once(
                f"exit-failed:{self.out}",
                f"while the session's block raised {type(exc).__name__}, the probe's final flush failed "
                f"too ({type(probe_failure).__name__}: {probe_failure}); the block's exception goes on",
            )
        finally:
            _active = None
            self._tracer = self._exit_stack = None

    def _close_modes_and_writer(self) -> None:
        """Close every mode and free the rank's lock, whichever of them fails; then raise the
        first failure."""
        failure = self._plugins.close()
        if self._escalation is not None:
            try:
                self._escalation.close()
            except BaseException as e:
                failure = failure or e
        try:
            self._writer.close()
        except BaseException as e:
            failure = failure or e
        if failure is not None:
            raise failure

    # -- without a with block ----------------------------------------------------

    def start(self) -> Session:
        """Begin the session without a ``with`` block (what ``with`` does on entry); end it with
        :meth:`stop`. A session runs once: start() on a running or stopped session raises
        :class:`ProbeError`; after a failed start() (an unwritable ``out``) it may be called again.

        >>> session = probe.mode("stats", out="runs/a", model=model).start()
        >>> for batch in data:
        ...     train_step(batch); session.step()
        >>> session.stop()
        """
        self.__enter__()  # refuses a running or a stopped session, as a with block does
        return self

    def stop(self, error: BaseException | None = None) -> None:
        """End the session (what ``with`` does on exit): write what the current step recorded and
        close the run directory. Safe to call again, and after a failed :meth:`start` (then it does
        nothing), so it fits a ``finally:`` clause.

        ``error``: the exception that ended training, when there was one; by default the exception
        being handled where stop() is called (in ``finally:`` or ``except:``). Then the step it broke
        off is written marked incomplete, as when a ``with`` block raises.
        """
        self._stop(error if error is not None else sys.exc_info()[1])

    def _stop(self, error: BaseException | None) -> None:
        """:meth:`stop` with the error said, never looked up (a training loop's callbacks know
        whether training ended normally, even when the loop runs inside someone's ``except:``)."""
        if self._tracer is None:
            return
        if self._forked_from is not None:
            self._stop_forked()
            return
        self._held = None
        if error is None:
            self.__exit__(None, None, None)
        else:
            self.__exit__(type(error), error, error.__traceback__)

    @property
    def running(self) -> bool:
        """Whether the session is between start (or ``with`` entry) and stop (or exit), in the
        process that started it (a forked child's copy is detached: not running)."""
        return self._tracer is not None and self._forked_from is None

    # -- pausing -----------------------------------------------------------------

    def pause(self) -> None:
        """Record nothing until :meth:`resume`: no op, no module call, nothing the modes collect
        from hooks (evaluation inside a training loop, a checkpoint save). The step stays open; a
        :meth:`step` while paused ends it and the next step starts paused. Pausing twice is once."""
        tracer = self._running_tracer("pause")
        if self._held is not None or self._forked_from is not None:
            return
        self._held = (tracer.recording, tracer.modules.enabled)
        tracer.recording = tracer.modules.enabled = False
        self._plugins.pause()

    def resume(self) -> None:
        """Record again after :meth:`pause` (from where the step was); no-op when not paused."""
        tracer = self._running_tracer("resume")
        held, self._held = self._held, None
        if held is None or self._forked_from is not None:  # a forked child's copy records nothing
            return
        tracer.recording, tracer.modules.enabled = held
        self._plugins.resume()

    @property
    def is_paused(self) -> bool:
        return self._held is not None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """``with session.paused():`` runs its block unrecorded (see :meth:`pause`), then records
        again, unless the session was paused already: then it stays paused."""
        self._running_tracer("paused")
        if self._held is not None:
            yield
            return
        self.pause()
        try:
            yield
        finally:
            if self._tracer is not None:  # the block may have stopped the session
                self.resume()

    def trace_thread(self) -> contextlib.AbstractContextManager[None]:
        """``with session.trace_thread():`` traces the ops its block runs on the calling thread.

        The session traces the thread that started it (a dispatch mode is per thread); on any
        other thread (training in a ``threading.Thread``) ops go unseen, and the module calls
        there are counted in the step's manifest (``untraced_threads``) with a warning. Run that
        thread's work inside this block to trace it. One thread at a time may run the model's
        ops: two at once would interleave their records."""
        return self._running_tracer("trace_thread").trace_thread()

    def _running_tracer(self, method: str) -> Tracer:
        if self._tracer is None:
            raise ProbeError(f"session.{method}() called outside the session (its with block, or between "
                             "start() and stop())")
        return self._tracer

    # -- steps -----------------------------------------------------------------

    def step(self) -> None:
        """End the current step: flush it to the run directory and start the next."""
        if self._tracer is None:
            raise ProbeError("session.step() called outside the session (its with block, or between "
                             "start() and stop())")
        if self._forked_from is not None:
            self._say_forked()
            return
        self._stopped_between_steps = False
        try:
            self._flush(complete=True, reason=None)
        except BaseException:
            # The step was handed over (or salvaged, incomplete): the with block's exit must
            # not write a second, empty one under its number.
            self._next_step()
            self._stopped_between_steps = True
            raise
        self._next_step()
        try:
            self._plugins.after_step()
        except BaseException:
            self._stopped_between_steps = True  # the next step has not run: nothing to write
            raise

    def step_fn(self, fn: Callable[[Any], Any], batch: Any, **state: Any) -> Any:
        """Run one training step ``fn(batch)`` (forward, backward, optimizer step; returns the loss)
        from a kept start, then end the step as :meth:`step` does; a non-finite loss or parameter, or a
        monitor alert about the step, rewinds it (docs/rewind.md). ``optimizer=``, ``scaler=``: what the
        step updates besides ``model=``; ``scheduler=``: the learning-rate scheduler ``fn`` steps (or a
        list of objects with ``state_dict``/``load_state_dict``), put back after the reruns;
        ``keep_grads=True`` where gradients accumulate across steps; ``keep_every=N``: the training
        state copied every N steps only, a rewind replaying the steps between (cheaper on small
        models; N + 1 batches kept). Returns what ``fn`` returned."""
        from probe.rewind import rewinder_of  # the rewind builds sessions of its own: imported late

        return rewinder_of(self).step_fn(fn, batch, **state)

    def rewind(self) -> Any:
        """Re-run the step :meth:`step_fn` ran last, classify it, and return its ``Verdict``."""
        from probe.rewind import rewinder_of

        return rewinder_of(self).rewind()

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """The session paused and not the active one for the block, so that another session (a
        rewind's rerun) can run inside it; active again afterwards."""
        global _active
        with self.paused():
            held, _active = _active, None
            try:
                yield
            finally:
                _active = held

    def rerun_session(self, out: str | os.PathLike, model: Any) -> Session:
        """A stats session of its own for a rerun of this session's step (``probe.rewind``): built
        here so that the rewind, which this session drives, imports no session."""
        return mode("stats", out=out, model=model, overwrite=True)

    def _wait_for_writer(self) -> None:
        """Until every ended step is on disk."""
        self._writer.drain()

    def _next_step(self) -> None:
        self.step_index += 1
        self._begin_step(current_rank())

    def _begin_step(self, rank: int) -> None:
        assert self._tracer is not None
        self._tracer.begin_step(self.step_index, rank)
        if self._escalation is not None:  # arms or disarms the trace modes, begins their step
            self._escalation.begin_step(self.step_index)
        self._plugins.begin_step(self.step_index)
        self.step_kind = None
        self._compiled_eager = 0
        if self._held is not None:  # paused across step(): the new step starts paused too
            self._held = None
            self.pause()
        self._step_started = time.perf_counter()

    def _flush(self, complete: bool, reason: str | None, tail: bool = False) -> None:
        """End the tracer's step and have it written (on the writer thread if any).

        An exception during the hand-over itself (Ctrl-C, a mode's ``end_step``) does not
        lose the step: what was handed over is written, marked incomplete, and then the
        exception goes on.
        """
        tracer = self._tracer
        assert tracer is not None
        step = tracer.step
        interrupted: BaseException | None = None
        with tracer.paused(), untraced():
            # The list end_step hands over, held before the call: an interruption inside it
            # (after the tracer has let go of the list) cannot lose the records.
            records = tracer.records
            try:
                records = tracer.end_step(wait=complete)
            except BaseException as e:
                interrupted = e
                with contextlib.suppress(BaseException):
                    tracer.end_step(wait=False)  # collectives still in flight are dropped
            escalated = self._escalation.modes_of(step) if self._escalation is not None else []
            ended, failed = self._plugins.end_step(step, tail or not complete or interrupted is not None,
                                                   escalated)
            interrupted = interrupted or failed
            if interrupted is not None:
                complete = False
                reason = f"{type(interrupted).__name__} during the step hand-over: {interrupted}"
            context = StepContext(self._step_started, self.step_kind, self._escalation_links,
                                  self._compiled_eager)
            try:
                job = self._writer.step_job(step, tail, tracer, records, ended, complete, reason, context)
            except BaseException as e:
                if interrupted is None:  # the job is plain data: made again, the step marked broken off
                    interrupted, complete = e, False
                    reason = f"{type(e).__name__} during the step hand-over: {e}"
                job = self._writer.step_job(step, tail, tracer, records, ended, complete, reason, context)
        try:
            if job is not None:
                self._writer.hand_over(job, wait=not complete)
        except BaseException:
            if interrupted is None:
                raise
            # The hand-over's own exception is the one the user sees.
        finally:
            self._writer.warn_failures()
        if interrupted is not None:
            raise interrupted

    def _escalation_links(self, step: int) -> dict[str, Any]:
        return self._escalation.manifest(step) if self._escalation is not None else {}

    def _compiled_ran_eagerly(self) -> None:
        if self._tracer is not None and self._tracer.recording:
            self._compiled_eager += 1

    def _warn_steps_not_reached(self) -> None:
        """Say which selected steps the session ended before (``steps=[100]`` in a 10-step run
        would otherwise leave an empty run without a word). A step ends at ``session.step()``:
        the one open at the end (a tail at most) is not reached either."""
        selected, reached = self.options.steps.ranges, self.step_index
        if self._writer.run is None or selected is None:  # an unselected rank records nothing anyway
            return
        missed = []
        for r in selected:
            rest = r[max(0, -(-(reached - r.start) // r.step)):]  # the part of r at or after `reached`
            if rest:
                missed.append(str(rest.start) if len(rest) == 1 else
                              f"{rest.start}-{rest[-1]}" if rest.step == 1 else repr(rest))
        if not missed:
            return
        ran = "no step" if reached == 0 else "step 0" if reached == 1 else f"steps 0-{reached - 1}"
        nothing = "" if any(r and r.start < reached for r in selected) else \
            "; the run holds none of the selected steps"
        warn_once(
            f"steps-not-reached:{self.out}",
            f"steps= selected step(s) {', '.join(missed)} that never ended: the session ran {ran} "
            f"(a step ends at session.step()){nothing}",
        )

    # -- a forked child's copy ----------------------------------------------------

    def _detach_forked(self, parent: int) -> None:
        """In a process forked while this session ran (``os.fork()``; run by the at-fork hook):
        the copy records nothing and writes nothing, for good.

        Its run writer would write the parent's step numbers again into the parent's run
        directory, and the threads that write (the step writer's, the dump's) were not forked:
        fork copies the forking thread only, so waiting for them (the next ``step()``, the end of
        the block, the exit) never ended. So the tracer and every mode stop collecting, as when
        paused; the writer is dropped unused, and this process's copy of the rank lock's
        descriptor is closed (an inherited descriptor would keep the parent's lock held after
        the parent lets it go, as long as the child lives). Nothing here waits for a lock or a
        thread. Said once, when the child first calls the session (:meth:`_say_forked`): a
        DataLoader's workers are forked children that never do, and stay quiet."""
        self._forked_from = parent
        tracer = self._tracer
        if tracer is not None:
            tracer.recording = tracer.modules.enabled = False
        self._held = None
        self._plugins.pause()
        self._writer.abandon_in_forked_child()

    def _say_forked(self) -> None:
        warn_once(
            f"forked:{os.getpid()}:{self.out}",
            f"this process (pid {os.getpid()}) was forked from pid {self._forked_from} while the session "
            f"writing {str(self.out)!r} ran there: its copy of the session is detached (it traces and "
            "writes nothing; step() and stop() return at once); the parent's run goes on",
        )

    def _stop_forked(self) -> None:
        """stop() or the end of the block in a forked child: take the tracer's hooks and dispatch
        mode out of this process; nothing is written or waited for (the step writer's close does
        nothing outside the process that made it), and nothing is raised."""
        self._say_forked()
        stack, self._exit_stack = self._exit_stack, None
        self._tracer = None
        if stack is not None:
            with contextlib.suppress(Exception):
                stack.close()


def _detach_in_forked_child() -> None:
    """The at-fork hook, in the child: a running session there is the parent's (detached)."""
    global _active
    session, _active = _active, None  # the child may start a session of its own
    if session is not None:
        with contextlib.suppress(Exception):  # a failure here would be printed by the interpreter
            session._detach_forked(os.getppid())


if hasattr(os, "register_at_fork"):  # (no fork, no hook: Windows)
    os.register_at_fork(after_in_child=_detach_in_forked_child)


def active_session() -> Session | None:
    """The running session (entered with ``with`` or started with ``start()``), or None."""
    return _active


def mode(modes: Any = None, **options: Any) -> Session:
    """Trace every aten op under one or more modes; see API.md for the options.

    >>> with probe.mode("stats", out="runs/a") as session:
    ...     loss = model(batch); loss.backward(); opt.step()
    ...     session.step()
    """
    return Session(modes, **options)
