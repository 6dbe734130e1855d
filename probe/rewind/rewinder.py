"""Rewind a bad step: put its start back, run it again under full tracing, and name the cause.

``session.step_fn(fn, batch)`` keeps each step's start (:class:`~probe.rewind.start.StepStart`),
runs ``fn(batch)`` and ends the step. A non-finite loss or parameter after the step, a monitor
anomaly of the step, or ``session.rewind()`` rewinds it, in this order (Megatron's rerun state
machine, extended past "persistent"):

1. the same step again, traced by the stats mode: when it ends differently from the original bit for
   bit (loss, parameters, buffers, optimizer state) the fault did not recur: **transient** (a hardware
   fault or non-determinism), the first op whose recorded values differ named when the original step
   was traced too;
2. it recurred: the whole step in float64 (parameters, buffers, optimizer state and batch upcast,
   autocast off); the anomaly vanishes: **precision**, named by the first non-finite op of rerun 1;
3. it recurs in float64: the step on the batch before; it vanishes: **data**, the samples named by
   their losses alone; else **code**, named by the first non-finite op of rerun 1.

Afterwards the state the original step ended with (kept when the rewind began, RNG included) is put
back, so training goes on bit-identical to training without the rewind. A rerun's failure is a
verdict ("not classified"), never the user's exception.
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from probe.errors import ProbeError, warn_once
from probe.local_part import local_part
from probe.rewind.determinism import HARDWARE, KERNEL, PROGRAM, deterministic_algorithms
from probe.rewind.interval import KeptSteps, checked_every
from probe.rewind.precision import float64_step
from probe.rewind.ranks import Ranks
from probe.rewind.start import Batch, StepStart, leaves, rebuild, same_bits
from probe.rewind.verdict import Rerun, Verdict, rewind_dir
from probe.rundir.run import load
from probe.tracer.mode_stack import untraced

if TYPE_CHECKING:
    from probe.rundir.records import OpRecord

Session = Any
"""A ``probe.session.Session``: the rewind is driven by the session and asks it for what it needs
(``set_aside``, ``rerun_session``, ``paused``, its options and modes), importing no session module
(the session imports this package)."""

MAX_SAMPLES = 64
"""Samples of a data verdict's batch whose losses are measured one by one (each is a step's rerun)."""
OUTLIER_MADS = 6.0
"""A finite sample loss this many scaled median absolute deviations above the median is named."""


@dataclass
class _Original:
    step: int
    fn: Callable[[Batch], Any]
    loss: torch.Tensor | None
    nonfinite: str | None


_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
"""What a parameter's finiteness sum accumulates in, where not its own dtype (fp32 or wider)."""


def nonfinite_after_step(loss: Any, params: list[torch.Tensor]) -> str | None:
    """Why a step's result is anomalous (a non-finite loss, or non-finite parameters after the
    optimizer took a non-finite gradient), or None. One host sync: one value per tensor, stacked,
    checked and read together."""
    with torch.no_grad():
        loss = local_part(loss) if isinstance(loss, torch.Tensor) else loss
        is_loss = isinstance(loss, torch.Tensor) and loss.is_floating_point()
        # The loss times 0, summed: 0 where every value is finite, NaN where one is not (any shape).
        values = [(loss * 0).sum(dtype=_SUM_DTYPE.get(loss.dtype, loss.dtype))] if is_loss else []
        # A sum is non-finite where one value is, and accumulated in fp32 (fp64 for fp64) only a
        # sum past 3.4e38 overflows (a 2-norm squares, past 1.8e19); the fastest of the
        # reductions on the CPU benchmark (the inf-norm and isfinite().all() were 9x slower,
        # _foreach_norm and _foreach_powsum slower still on the CPU).
        # This rank's shard of a sharded parameter: the ranks' verdicts are combined afterwards.
        values += [local_part(p).sum(dtype=_SUM_DTYPE.get(p.dtype, p.dtype))
                   for p in params if p.is_floating_point()]
        if not values:
            return None
        try:
            stacked = torch.stack(values)
        except RuntimeError:  # parameters on several devices (a pipeline's stages): gathered on one
            stacked = torch.stack([v.to(values[0].device) for v in values])
        finite = torch.isfinite(stacked).tolist()
    if is_loss and not finite[0]:
        return "non-finite loss"
    if not all(finite[1:] if is_loss else finite):
        return "non-finite parameter after the step"
    return None


TRIGGERS = ("non-finite loss", "non-finite parameter after the step", "monitor")
"""What makes a rank rewind, as it tells the other ranks (a code: the index + 1)."""


def _reason(code: int) -> str:
    return TRIGGERS[code - 1] if code <= len(TRIGGERS) else "a rewind"


class Rewinder:
    """A session's rewind: the kept start, the step last run, the verdicts (one per session)."""

    def __init__(self, session: Session) -> None:
        self._session = weakref.ref(session)
        self.start: StepStart | None = None
        self.interval: KeptSteps | None = None
        """The steps since the last whole copy, where ``step_fn(keep_every=N > 1)`` makes one every N
        steps."""
        self.last: _Original | None = None
        self.verdicts: list[Verdict] = []
        self._heard: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._listening = False
        self.ranks: Ranks | None = None
        """The job's ranks, read at the first kept start (the process group may come after the session)."""

    @property
    def session(self) -> Session:
        session = self._session()
        assert session is not None
        return session

    def _model(self) -> torch.nn.Module:
        model = self.session.options.model
        if isinstance(model, dict) and len(model) == 1:
            model = next(iter(model.values()))
        if not isinstance(model, torch.nn.Module):
            raise ProbeError("session.step_fn() keeps the model's start and needs it: pass model=<the root "
                             "module> to probe.mode(...)")
        return model

    # -- each step ------------------------------------------------------------------

    def step_fn(self, fn: Callable[[Batch], Any], batch: Batch,
                optimizer: torch.optim.Optimizer | None = None, scaler: Any = None,
                keep_grads: bool = False, scheduler: Any = None, keep_every: int = 1) -> Any:
        attached = optimizer is not None and getattr(optimizer.step, "_wrapped_by_lr_sched", False)
        if scheduler is None and attached:
            warn_once("rewind-scheduler", "step_fn: a learning-rate scheduler is attached to the optimizer; "
                      "if fn steps it, pass scheduler=<it> so that a rewind puts it back (each rerun of the "
                      "step would step it again)")
        self.keep_start(batch, optimizer, scaler, keep_grads, scheduler, keep_every=keep_every, fn=fn)
        loss = fn(batch)
        trigger = self.step_ran(fn, loss)
        self.session.step()
        self.step_ended(trigger)
        return loss

    def keep_start(self, batch: Batch | None, optimizer: torch.optim.Optimizer | None = None,
                   scaler: Any = None, keep_grads: bool = False, scheduler: Any = None,
                   keep_every: int = 1, fn: Callable[[Batch], Any] | None = None) -> None:
        """Before a step the loop runs itself (a framework's callback): keep its start, ``batch``
        what it will run on (None: given to :meth:`keep_batch` when the step ran). ``scheduler``:
        what else the step advances (one object or several, each with ``state_dict`` and
        ``load_state_dict``: the learning-rate scheduler ``fn`` steps). ``keep_every=N``: the
        training state copied every N steps, the steps between replayed by ``fn`` on a rewind
        (:mod:`probe.rewind.interval`; needs the batch and ``fn`` now)."""
        session = self.session
        session._running_tracer("step_fn")
        model = self._model()
        stateful = _stateful(scheduler)
        start = self.start
        if start is None or (start.model, start.optimizer, start.scaler, start.keep_grads,
                             start.stateful) != (model, optimizer, scaler, keep_grads, stateful):
            start = self.start = StepStart(model, optimizer, scaler, keep_grads, stateful)
        interval = None
        if checked_every(keep_every) != 1:
            if fn is None or batch is None:
                raise ProbeError(f"keep_every={keep_every!r} replays the steps between two kept starts and "
                                 "needs each step's batch and function: use session.step_fn(fn, batch, "
                                 "keep_every=...)")
            interval = self.interval
            if interval is None or interval.start is not start or interval.every != keep_every:
                interval = KeptSteps(start, keep_every)
        self.interval = interval
        self._listen()
        if self.ranks is None:
            self.ranks = Ranks()
        with untraced():  # the probe's own copies are no ops of the step
            if interval is not None:
                assert fn is not None
                interval.keep(session.step_index, batch, fn)
            else:
                start.keep(session.step_index, batch)

    def keep_batch(self, batch: Batch) -> None:
        """The batch of the step kept by :meth:`keep_start` with none (a loop that hands the step its
        micro-batches one by one): every micro-batch, given when the step ran them all."""
        if self.start is not None:
            with untraced():
                self.start.keep_batch(batch)

    def step_ran(self, fn: Callable[[Batch], Any], loss: Any) -> str | None:
        """The step kept by :meth:`keep_start` ran and returned ``loss`` (before ``session.step()``):
        ``fn(batch)`` is how to run it again. Returns why it must be rewound (a non-finite loss or
        parameter, the first of a run of such steps: the ones after inherit its values), or None;
        the caller ends the step (``session.step()``), then calls :meth:`step_ended` with it."""
        with untraced():
            nonfinite = nonfinite_after_step(loss, self.start.parameters if self.start is not None
                                             else list(self._model().parameters()))
            kept = loss.detach().clone() if isinstance(loss, torch.Tensor) else None
        began_here = nonfinite is not None and (self.last is None or self.last.nonfinite is None)
        self.last = _Original(self.session.step_index, fn, kept, nonfinite)
        if self.interval is not None:
            self.interval.ran(self.last.step, kept)
        return nonfinite if began_here else None

    def _listen(self) -> None:
        """Hear the monitor's alerts (on the writer thread), to rewind the step they are about."""
        if self._listening:
            return
        self._listening = True
        for mode in self.session.modes:
            detector = getattr(mode, "detector", None)
            if detector is not None and hasattr(detector, "listeners"):
                detector.listeners.append(self._heard.put)

    def step_ended(self, trigger: str | None) -> None:
        """After ``session.step()`` ended the step :meth:`step_ran` saw: rewind it for ``trigger``, or
        for a monitor alert about it. Now, at the step's end: what the loop does before the next step
        (zeroing gradients, a data loader drawing its seed, a validation) is no part of the end state
        the rerun is compared with."""
        if trigger is None:
            trigger = self._alert_trigger()
        ranks = self.ranks or Ranks()
        if not ranks.distributed:
            if trigger is not None:
                self.rewind(trigger)
            return
        # Every rank rewinds together, or none: one all_reduce of why each rank would (0: it would not).
        reason = 0 if trigger is None else next(
            (i for i, r in enumerate(TRIGGERS, 1) if trigger.startswith(r)), len(TRIGGERS) + 1)
        codes = ranks.codes(reason)
        if any(codes):
            self.rewind(", ".join(f"{trigger if r == ranks.rank else _reason(c)} on rank {r}"
                                  for r, c in enumerate(codes) if c))

    def _alert_trigger(self) -> str | None:
        """A monitor alert about the step run last, as a rewind's trigger. The monitor's rules run
        when the step is on disk, so the step's write is waited for here."""
        last = self.last
        if last is None or last.nonfinite is not None or not any(
                getattr(mode, "detector", None) is not None for mode in self.session.modes):
            return None
        self.session._wait_for_writer()
        alerts = []
        while not self._heard.empty():
            alerts.extend(a for a in self._heard.get() if a.step == last.step)
        if not alerts:
            return None
        first = alerts[0]
        return f"monitor {first.rule}: {first.module} {first.metric}"

    # -- the rewind -------------------------------------------------------------------

    def rewind(self, trigger: str = "requested") -> Verdict | None:
        """Rewind the step :meth:`step_fn` ran last; returns its verdict (None when it could not be
        written: said in a warning). Training state afterwards: the original step's end, bit for bit."""
        session = self.session
        session._running_tracer("rewind")
        last, start, interval = self.last, self.start, self.interval
        if last is None or start is None or not (
                start.step == last.step if interval is None else interval.holds(last.step)):
            raise ProbeError("session.rewind() re-runs the step session.step_fn(fn, batch) ran last; no step "
                             "ran through step_fn in this session")
        began = time.perf_counter()
        session._wait_for_writer()  # the original step's records are on disk, to compare with
        end = StepStart(start.model, start.optimizer, start.scaler, keep_grads=True,  # exact: all of it
                        stateful=start.stateful)
        with untraced():
            end.keep(last.step)
        rank = session._tracer.rank if session._tracer is not None else 0
        ranks = self.ranks or Ranks()
        try:
            with session.set_aside():  # nothing of the rewind is an op of the step the session is in
                if interval is not None:
                    with untraced():
                        start = interval.start_of(last.step)
                verdict = _Classification(self, last, start, end, rank, ranks, trigger).run()
                replayed = interval.replayed(last.step) if interval is not None else None
                if replayed is not None and verdict.verdict == "transient":
                    verdict.why += (f"; its start was replayed from the whole copy of step {replayed} "
                                    f"(keep_every={interval.every}): a write to the training state between "
                                    "steps that bumps no version counter (in place through .data) would also "
                                    "read as this")
        except Exception as e:  # the probe never raises into training: the failure is the verdict
            verdict = Verdict(last.step, rank, trigger, "not classified", f"{type(e).__name__}: {e}")
        finally:
            with untraced():
                end.restore()
        verdict.seconds = round(time.perf_counter() - began, 3)
        self.verdicts.append(verdict)
        try:
            verdict.write(session.out)
        except OSError as e:
            warn_once(f"rewind-write:{session.out}", f"cannot write the rewind verdict of step {last.step} "
                      f"({e}); it is in session.rewind()'s return value only")
        for mode in session.modes:  # the series the modes write per step (the monitor's)
            try:
                mode.rewound(Path(session.out), last.step, verdict.verdict)
            except Exception as e:  # the probe never raises into training
                warn_once(f"rewind-series:{mode.name}", f"the {mode.name} mode could not add the rewind "
                          f"verdict of step {last.step} to its series ({type(e).__name__}: {e})")
        return verdict


@dataclass
class _End:
    """How a run of the step ended: its loss and its end state, for a rerun to be compared with."""

    loss: torch.Tensor | None
    state: StepStart

    def equals(self, loss: Any) -> bool:
        """Whether a run that just returned ``loss`` ended as this one, bit for bit."""
        if self.loss is None or not isinstance(loss, torch.Tensor):
            return self.loss is None and not isinstance(loss, torch.Tensor) and self.state.equals_live()
        return same_bits(self.loss, loss) and self.state.equals_live()


class _Classification:
    """The reruns of one rewind and the verdict they lead to."""

    def __init__(self, rewinder: Rewinder, original: _Original, start: StepStart, end: StepStart,
                 rank: int, ranks: Ranks, trigger: str) -> None:
        self.rewinder, self.original, self.start, self.end = rewinder, original, start, end
        self.rank, self.ranks, self.trigger = rank, ranks, trigger
        self.out = Path(rewinder.session.out)
        self.reruns: list[Rerun] = []
        self.same_end: _End | None = None
        """How the first rerun ended (a second rerun is compared with it)."""
        self.deterministic_end: _End | None = None

    def verdict(self, kind: str, why: str, located: dict[str, Any] | None = None,
                ranks: list[int] | None = None) -> Verdict:
        """``ranks``: where the cause was found (every rank, where not said)."""
        world = self.ranks.world
        return Verdict(self.original.step, self.rank, self.trigger, kind, why, located, reruns=self.reruns,
                       ranks=list(range(world)) if ranks is None else ranks, world=world)

    def run(self) -> Verdict:
        # Each decision is every rank's (Ranks): the ranks run the same reruns, their collectives meet.
        ranks = self.ranks
        same = self.rerun("same", self.start.batch.get())
        if ranks.any(same.error is not None):
            return self.verdict("not classified", f"the rerun raised {same.error or 'on another rank'}")
        differed = ranks.where(not same.bitwise_equal)
        if differed:
            return self.transient(same, differed)
        if not ranks.any(self.original.nonfinite is not None):
            return self.verdict("reproducible", "the rerun equals the original bit for bit and nothing in it "
                                "is non-finite: no cause to look for")
        located = self.first_nonfinite(same)
        wide = self.rerun("float64", self.start.batch.get(), float64=True)
        if ranks.any(wide.error is not None):
            raised = wide.error or "on another rank"
            return self.verdict("not classified", f"the float64 rerun raised {raised}", located)
        if not ranks.any(wide.nonfinite is not None):
            return self.verdict("precision", "recurs in the original precision, vanishes in float64", located)
        if self.start.previous_step is not None:
            before = self.rerun("previous_batch", self.start.previous_batch.get())
            if not ranks.any(before.error is not None):
                if not ranks.any(before.nonfinite is not None):
                    return self.data_verdict("recurs in float64, vanishes on the batch before")
                return self.verdict("code", "recurs in float64 and on the batch before", located)
        samples = self.sample_losses()  # no batch before (the first step): the samples alone decide
        if ranks.any(any(loss is not None and math.isfinite(loss) for loss in samples)) and ranks.any(any(
                loss is None or not math.isfinite(loss) for loss in samples)):
            return self.data_verdict("recurs in float64; some samples alone are finite, others not")
        return self.verdict("code", "recurs in float64 and in every sample alone", located)

    def transient(self, same: Rerun, differed: list[int]) -> Verdict:
        """The rerun ended differently from the original: its cause, by a second rerun (and, where the
        two reruns differ, two under deterministic algorithms); see ``probe.rewind.determinism``."""
        located = self.first_difference(same)
        if located is None:
            why = "the same step from the same start ended differently bit for bit; no op named: the " \
                  "original step was not traced"
        else:
            why = "the same step from the same start ended differently bit for bit"
        verdict = self.verdict("transient", why, located, differed)
        ranks = self.ranks
        again = self.rerun("same again", self.start.batch.get(), against=self.same_end)
        if ranks.any(again.error is not None):
            verdict.evidence = f"cause not told: the second rerun raised {again.error or 'on another rank'}"
            return verdict
        if ranks.all(bool(again.bitwise_equal)):
            verdict.cause = HARDWARE
            verdict.evidence = ("one-off: two reruns from the kept start agree bit for bit and the original "
                                "alone differs (a hardware fault, or non-determinism too rare for two reruns "
                                "to show)")
            return verdict
        between = self.first_difference(again, self.out / (same.run or ""), 0)
        if between is not None:
            verdict.located = {**between, "how": "the first op whose recorded values differ between the "
                               "two reruns"}
        first = self.rerun("deterministic", self.start.batch.get(), deterministic=True, traced=False,
                           keep_end=True)
        second = first if ranks.any(first.error is not None) else self.rerun(
            "deterministic again", self.start.batch.get(), deterministic=True, traced=False,
            against=self.deterministic_end)
        differs = "the two reruns from the kept start differ from each other too"
        if ranks.any(second.error is not None):
            verdict.evidence = f"{differs}; kernel or program not told: a deterministic rerun raised " \
                               f"{second.error or 'on another rank'}"
        elif ranks.all(bool(second.bitwise_equal)):
            verdict.cause = KERNEL
            verdict.evidence = (f"{differs}; two under torch.use_deterministic_algorithms(True) agree bit "
                                "for bit: a kernel's non-determinism, which the flag removes")
        else:
            verdict.cause = PROGRAM
            verdict.evidence = (f"{differs}, and under torch.use_deterministic_algorithms(True) too: the "
                                "step reads something its kept start does not hold (a global counter, the "
                                "clock, an unseeded generator, Python state)")
        return verdict

    # -- reruns ---------------------------------------------------------------------------

    def rerun(self, kind: str, batch: Batch, float64: bool = False, traced: bool = True,
              deterministic: bool = False, against: _End | None = None, keep_end: bool = False) -> Rerun:
        """The step again from its start, on ``batch``, traced by the stats mode into its own run;
        compared bit for bit with ``against`` (the "same" rerun: with the original's end), and its own
        end kept for a later rerun to be compared with (the "same" rerun always)."""
        session, start = self.rewinder.session, self.start
        if kind == "same":
            against, keep_end = _End(self.original.loss, self.end), True
        directory = rewind_dir(self.out, self.rank, self.original.step) / kind.replace(" ", "_")
        result = Rerun(kind, None, None, run=str(directory.relative_to(self.out)) if traced else None)
        self.reruns.append(result)
        with session.set_aside(), contextlib.ExitStack() as stack:
            with untraced():
                start.restore()
            try:
                if float64:
                    batch = stack.enter_context(float64_step(start.model, start.optimizer, batch))
                if deterministic:
                    stack.enter_context(deterministic_algorithms())
                if traced:
                    stack.enter_context(session.rerun_session(directory, start.model))
                loss = self.original.fn(batch)
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
                return result
            with untraced():
                result.nonfinite = nonfinite_after_step(loss, list(start.model.parameters()))
                if against is not None:
                    result.bitwise_equal = against.equals(loss)
                if keep_end:
                    end = StepStart(start.model, start.optimizer, start.scaler, keep_grads=True,
                                    stateful=start.stateful)
                    end.keep(self.original.step)
                    kept = _End(loss.detach().clone() if isinstance(loss, torch.Tensor) else None, end)
                    if deterministic:
                        self.deterministic_end = kept
                    else:
                        self.same_end = kept
        if isinstance(loss, torch.Tensor):
            result.loss = float(loss.detach().double().mean())
        return result

    def sample_losses(self) -> list[float | None]:
        """Each sample's loss alone (the step re-run on it from its start, untraced)."""
        batch = self.start.batch.get()
        size = _batch_size(batch)
        losses: list[float | None] = []
        for index in range(self.ranks.minimum(min(size, MAX_SAMPLES))):
            rerun = self.rerun(f"sample {index}", _sample(batch, index, size), traced=False)
            self.reruns.pop()
            losses.append(rerun.loss)
        return losses

    def data_verdict(self, why: str) -> Verdict:
        losses = self.sample_losses()
        bad = [i for i, loss in enumerate(losses) if loss is None or not math.isfinite(loss)]
        if not self.ranks.any(bool(bad)):  # no rank holds a non-finite sample: the outliers are named
            finite = sorted(x for x in losses if x is not None)
            if finite:
                median = finite[len(finite) // 2]
                spread = 1.4826 * sorted(abs(x - median) for x in finite)[len(finite) // 2]
                bad = [i for i, loss in enumerate(losses)
                       if loss is not None and spread > 0 and loss > median + OUTLIER_MADS * spread]
        verdict = self.verdict("data", why, ranks=self.ranks.where(bool(bad)))
        verdict.samples = bad
        verdict.sample_losses = [None if x is None or not math.isfinite(x) else x for x in losses]
        return verdict

    # -- naming the op ----------------------------------------------------------------------

    def first_nonfinite(self, rerun: Rerun) -> dict[str, Any] | None:
        if rerun.run is None:
            return None
        bad = load(self.out / rerun.run).first_nonfinite()
        return None if bad is None else _located(bad, "the first non-finite op of the rerun")

    def first_difference(self, rerun: Rerun, run: Path | None = None, step: int | None = None
                         ) -> dict[str, Any] | None:
        """The first op of a run's step (the original step; or step ``step`` of ``run``, another
        rerun) whose recorded values the rerun does not reproduce; None when that step recorded no
        ops (not traced: not compared)."""
        try:
            original = load(run or self.out).ops(step=self.original.step if step is None else step,
                                                 rank=self.rank)
        except (ProbeError, OSError, KeyError, ValueError):
            return None
        if not original or rerun.run is None:
            return None
        again = {op.id: op for op in load(self.out / rerun.run).ops(step=0, rank=self.rank)}
        for op in original:
            other = again.get(op.id)
            if other is None:
                return _located(op, "ran in the original step only")
            if _values(op.outputs) != _values(other.outputs):
                inputs_differ = _values(op.inputs) != _values(other.inputs)
                how = "inputs and outputs differ" if inputs_differ else "outputs differ"
                return _located(op, f"the first op whose recorded values differ ({how})")
        return None


def _values(tensors: list[Any]) -> list[tuple[tuple[str, str], ...]]:
    """Recorded statistics as comparable text (NaN equals NaN; a skipped tensor compares as itself)."""
    return [tuple(sorted((k, repr(v)) for k, v in (t.stats or {}).items())) for t in tensors]


def _located(op: OpRecord, how: str) -> dict[str, Any]:
    return {"op": op.id, "name": op.name, "module": op.module, "how": how}


def _batch_size(batch: Batch) -> int:
    sizes = [t.shape[0] for t in leaves(batch) if t.dim() > 0]
    return max(sizes) if sizes else 0


def _sample(batch: Batch, index: int, size: int) -> Batch:
    """Sample ``index`` of ``batch``: every tensor with ``size`` rows sliced to that row."""
    return rebuild(batch, iter([t[index:index + 1] if t.dim() > 0 and t.shape[0] == size else t
                                for t in leaves(batch)]))


_REWINDERS: weakref.WeakKeyDictionary[Session, Rewinder] = weakref.WeakKeyDictionary()


def _stateful(scheduler: Any) -> tuple[Any, ...]:
    """``scheduler=`` as a tuple of objects, each checked for ``state_dict``/``load_state_dict``."""
    if scheduler is None:
        return ()
    items = tuple(scheduler) if isinstance(scheduler, (list, tuple)) else (scheduler,)
    for item in items:
        if not all(callable(getattr(item, method, None)) for method in ("state_dict", "load_state_dict")):
            raise ProbeError(f"step_fn(scheduler={item!r}): the rewind keeps what the step advances by its "
                             "state_dict() and puts it back by load_state_dict(); this object has no such "
                             "methods (pass an LR scheduler, or a list of objects that have them)")
    return items


def rewinder_of(session: Session) -> Rewinder:
    """The session's rewinder, made on first use."""
    rewinder = _REWINDERS.get(session)
    if rewinder is None:
        rewinder = _REWINDERS[session] = Rewinder(session)
    return rewinder
