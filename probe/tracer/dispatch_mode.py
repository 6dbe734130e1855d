"""The tracer: one TorchDispatchMode that sees every aten op, forward and backward.

Per op it answers, from caches, "is this op selected here?" (an unselected op
costs a few dict lookups), and for selected ops builds an :class:`OpCall`
(stable id, phase, module frame, tensor metadata, provenance) and hands it to
the modes before and after the op runs. Work the tracer or the modes do inside
``__torch_dispatch__`` is never traced: the mode is popped while its handler
runs. Work done outside it (step flushes) runs under :meth:`Tracer.paused`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    _pop_mode,
    _push_mode,
)

from probe.errors import warn_once
from probe.rundir.op_record_fields import InputMeta, OpRecordTuple, OutputMeta, Skipped
from probe.tracer.call_constants import call_constants
from probe.tracer.call_sites import CallSites
from probe.tracer.collectives import GroupCache, PendingCollectives, collective_outputs
from probe.tracer.dtensor_layouts import LayoutLabeller, dtensor_class
from probe.tracer.frames import Frame
from probe.tracer.module_tracker import ModuleTracker
from probe.tracer.never_compiled import never_compiled
from probe.tracer.observer import OpObserver
from probe.tracer.op_call import OpCall
from probe.tracer.region_files import RegionFiles
from probe.tracer.value_ids import DTYPE_NAMES, UNKEYABLE_ERRORS, ValueIndex, unkeyable
from probe.tracer.value_ids import dtype_name as dtype_name  # where the modes import it from
from probe.vocabulary.op_class import OpClass, OpClassCache
from probe.vocabulary.op_tensors import counted_writes, tensors_in, tensors_out, written_tensors
from probe.vocabulary.session_options import Options

_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)
_get_infra_mode = torch._C._get_dispatch_mode
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
# Fake and proxy (make_fx) modes run below every user mode: while either is
# active, the ops we see compute nothing real.
_TRACING_MODE_KEYS = tuple(
    getattr(torch._C._TorchDispatchModeKey, name)
    for name in ("FAKE", "PROXY")
    if hasattr(torch._C._TorchDispatchModeKey, name)
)
_NODE_CREATING_PHASES = ("forward", "recompute")


def _shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The shape, or () for a tensor that has none (a nested tensor's ragged dims)."""
    return () if t.is_nested else tuple(t.shape)





def _storage_key(t: torch.Tensor) -> int | None:
    """``t``'s storage, as the buffers being filled are known by; None for a tensor without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None

class Tracer:
    """Routing and bookkeeping for one session; the dispatch mode calls :meth:`dispatch`."""

    def __init__(self, options: Options, observers: list[OpObserver], rank: int) -> None:
        self.options = options
        self._replacer = next((o for o in observers if o.replaces_execution), None)
        # Only observers that override a hook are called for it.
        self._before_modes = [o for o in observers if type(o).before is not OpObserver.before]
        self._after_modes = [o for o in observers if type(o).after is not OpObserver.after]
        self._observed = bool(self._before_modes or self._after_modes or self._replacer)
        """Some mode sees the op calls (``structure`` overrides no hook: no OpCall to build)."""
        self.mode_failures: dict[str, str] = {}
        """Observing modes whose per-op work raised, by name: where and what (see
        :meth:`_detach_failed`). Kept for the session; each later step's manifest lists them."""
        self.modules = ModuleTracker(options.model)
        self.modules.traces_current_thread = self._traces_current_thread
        self.call_sites = CallSites() if options.stack else None
        self.rank = rank
        self.step = 0
        self.recording = False
        self._step_recorded = False
        """This step is one of the ``steps`` and ``ranks`` recorded (``recording`` may be paused)."""
        self.records: list[OpRecordTuple] = []
        self.opened_regions: list[tuple[str, int, int]] = []
        """This step's compiled region ops whose graphs were re-run node by node, each node's ops
        recorded in its module (``probe.tracer.region_replay``): (region op id, index of the
        first op of the re-run, index after its last)."""
        self.region_files: RegionFiles | None = None
        """Where kept compiled region graphs (and, when asked, their tensors) are written; set by
        the session under ``compiled="keep"``."""
        self.values = ValueIndex()
        self._unwritten: set[int] = set()
        """Indices of this step's ops whose outputs are memory nothing has written yet."""
        self._partly_written: dict[int, list[int]] = {}
        """Buffers nothing wrote before this step's ops began to fill them piece by piece (a
        ``new_empty`` whose slices are copied into one by one), by storage: [elements written so
        far, elements the buffer holds]. A view into one is memory nothing wrote yet, until the
        writes add up to the whole buffer."""
        self._refilled: dict[int, weakref.ref[torch.Tensor]] = {}
        """Buffers an op with ``refills_buffers`` wrote, by ``id``: reallocated before each such
        op (outside any op), so a view of one taken before it holds garbage. Kept across steps."""
        self.groups = GroupCache()
        self.layouts = LayoutLabeller()
        self.pending = PendingCollectives(self._finish)
        self._classes = OpClassCache(on_math_bit_view=self.values.track_math_bits)
        self._by_id = self._classes.by_id
        self._selected: dict[tuple[int, str, str], bool] = {}
        """``(id(func), module, phase) -> selected``: the funcs stay alive in ``_classes``."""
        self._ops_re = options.ops.regex
        self._modules_re = options.modules.regex
        self._phases = options.phases
        self._filtered = self._ops_re is not None or self._modules_re is not None
        """Whether ``ops`` or ``modules`` filters ops; without, the phase alone selects (no look-up)."""

    # -- threads -------------------------------------------------------------------

    def _traces_current_thread(self) -> bool:
        """Whether the calling thread's dispatch stack holds a mode of this tracer."""
        return any(isinstance(m, ProbeDispatchMode) and m.tracer is self
                   for m in _get_current_dispatch_mode_stack())

    @contextmanager
    def trace_thread(self) -> Iterator[None]:
        """Trace the calling thread's ops inside the block: the tracer's dispatch mode is entered
        on this thread (dispatch modes are per thread) and taken off at the end. On a thread
        that is traced already it does nothing. Records are appended in the order ops run: one
        thread at a time may run the model's ops, as two at once would interleave their records
        and module frames."""
        ident = threading.get_ident()
        if ident in self.modules.traced_threads or self._traces_current_thread():
            yield
            return
        with ProbeDispatchMode(self):
            self.modules.traced_threads.add(ident)
            try:
                yield
            finally:
                self.modules.traced_threads.discard(ident)

    # -- step lifecycle --------------------------------------------------------

    def begin_step(self, step: int, rank: int) -> None:
        self.step = step
        self.rank = rank
        self.records = []
        self.opened_regions = []
        self.values.clear()
        self._unwritten.clear()
        self._partly_written.clear()
        self.modules.reset_step()
        active = step in self.options.steps and rank in self.options.ranks
        self.recording = self._step_recorded = active
        self.modules.enabled = active

    def end_step(self, wait: bool = True) -> list[OpRecordTuple]:
        """Hand over the step's records. ``wait=False`` (the step raised): async collectives
        still in flight are dropped unread rather than waited for, as their peers may be gone."""
        if self.pending.in_flight:
            with self.paused():
                if wait:
                    self.pending.drain()
                else:
                    self.pending.abandon()
        records = self.records
        if self._step_recorded and not records:
            self._warn_if_filters_match_nothing()
        # Until the next begin_step nothing is recorded, even when end_step ran inside paused():
        # the step's write (without a writer thread) would otherwise be traced into the next step.
        self.recording = self._step_recorded = False
        self.modules.enabled = False
        self.records = []
        self.values.clear()
        return records

    def _warn_if_filters_match_nothing(self) -> None:
        """A recorded step selected no op although ops ran: if the ``ops``/``modules`` filters
        have selected none so far (in any step), say so once: they may be misspelled."""
        selected = self._selected
        if not selected or any(selected.values()):
            return
        filters = [
            f"{name}={list(patterns.globs)}"
            for name, patterns in (("ops", self.options.ops), ("modules", self.options.modules))
            if patterns.globs is not None
        ]
        phases = self.options.phases
        ran = sorted({f"{self._by_id[func_id].name} in {fqn or '<top>'!r} ({phase})"
                      for func_id, fqn, phase in selected if phase in phases})
        if not filters or not ran:
            return  # the phases filter alone: a step may well have no op of those phases
        examples = "; ".join(ran[:3]) + ("; ..." if len(ran) > 3 else "")
        warn_once(
            f"filters-match-nothing:{filters}",
            f"{' and '.join(filters)} selected none of the {len(ran)} op kinds that ran in step "
            f"{self.step} (e.g. {examples}), so it has no op records; is a filter misspelled? "
            "ops match full names (aten.mm.default) or short ones (mm), modules module paths.",
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run the probe's own torch work without recording it."""
        recording, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = recording and self._step_recorded

    # -- per op ------------------------------------------------------------------

    def _is_selected(self, info: OpClass, fqn: str, phase: str) -> bool:
        if phase not in self.options.phases:
            return False
        ops_re = self._ops_re
        if ops_re is not None and not (ops_re.fullmatch(info.name) or ops_re.fullmatch(info.short)):
            return False
        return self._modules_re is None or self._modules_re.fullmatch(fqn) is not None

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.recording:
            return func(*args, **kwargs)
        # By id: an OpOverload hashes in Python, a call per lookup (see OpClassCache.by_id).
        info = self._by_id.get(id(func))
        if info is None:
            info = self._classes[func]
        if info.passthrough:
            if info.region:
                self._note_region(info, args)
            return func(*args, **kwargs)
        if self.pending.in_flight and PendingCollectives.may_read(info):
            return self._dispatch_reading_pending(func, info, args, kwargs)
        return self._route(func, info, args, kwargs)

    def _dispatch_reading_pending(self, func: Any, info: OpClass, args: tuple, kwargs: dict) -> Any:
        """An op touches async collective results: their ``after`` runs before it reads them, or
        after it when it completes them (``wait_tensor``; a backend's ``copy_`` of the result
        into the output buffer). See ``probe.tracer.collectives``."""
        taken = self.pending.take_read_by(tensors_in(args, kwargs))
        if taken and PendingCollectives.completes(info):
            out = self._route(func, info, args, kwargs)
            written = written_tensors(info, args, kwargs) if info.counts_writes else []
            for deferred in taken:
                deferred.call.writes_in_flight = written
            self.pending.finish(taken)
            return out
        self.pending.finish(taken)
        return self._route(func, info, args, kwargs)

    def _note_region(self, info: OpClass, args: tuple) -> None:
        if info.region > 0:
            self.modules.enter_region(args[0] if args and isinstance(args[0], str) else "")
        else:
            self.modules.exit_region()

    def run_region(self, func: Any, info: OpClass, inputs: list[Any]) -> Any:
        """One call of a compiled graph (``func(inputs)``, see probe.tracer.compiled_regions),
        routed and recorded as one op; the graph itself runs untraced."""
        if id(func) not in self._by_id:
            self._classes.add(func, info)
        out = self._route(func, info, (inputs,), {})
        # The graph runs inside an autograd Function's forward, with grad off: the node that
        # will run its backward is the newest one, which the op could not claim itself.
        phase, frame = self.modules.locate()
        if phase == "forward":
            with torch.enable_grad():
                self.modules.note_autograd_node(frame)
        return out

    def _route(self, func: Any, info: OpClass, args: tuple, kwargs: dict) -> Any:
        phase, frame = self.modules.locate()
        if self.modules.region is not None and phase != "optimizer":
            frame = self.modules.region
        if self._filtered:
            fqn = frame.origin.fqn
            route = (id(func), fqn, phase)
            selected = self._selected.get(route)
            if selected is None:
                selected = self._selected[route] = self._is_selected(info, fqn, phase)
        else:
            selected = phase in self._phases
        if not selected:
            out = func(*args, **kwargs)
            if phase in _NODE_CREATING_PHASES:
                self.modules.note_autograd_node(frame)
            return out
        return self._record(func, info, phase, frame, args, kwargs)

    def _record(
        self, func: Any, info: OpClass, phase: str, frame: Frame, args: tuple, kwargs: dict
    ) -> Any:
        # The hot path of every selected op: plain tuples, no per-tensor objects, one call into
        # the value index for the inputs and one for the results (not one per tensor). An OpCall
        # is built only for modes to see (``structure`` alone has none) and for collectives.
        origin = frame.origin
        count_key = (phase, info.name)
        op_counts = origin.op_counts
        n = op_counts.get(count_key, 0)
        op_counts[count_key] = n + 1
        index = len(self.records)
        constants = call_constants(info, args, kwargs) if info.has_constants else ()
        in_tensors = tensors_in(args, kwargs)
        skipped: tuple[Skipped, ...] = ()
        try:
            inputs = self.values.describe_inputs(in_tensors)
        except UNKEYABLE_ERRORS:
            inputs, skipped = self._inputs_skipping_unkeyable(in_tensors)
        op_id = f"{phase}:{origin.key}:{info.name}:{n}"
        parameter = (self.modules.updated.label(inputs, in_tensors, self.records)
                     if phase == "optimizer" else None)
        callsite = self.call_sites.capture(origin.fqn) if self.call_sites is not None else None
        call = (OpCall(index, op_id, info, phase, frame, inputs, in_tensors, args, kwargs, callsite, func)
                if self._observed or info.is_collective else None)
        outputs: list[OutputMeta] = []
        try:
            # The outputs hold memory nothing wrote yet (``empty``), or are a view into an
            # ``empty`` or reallocated buffer nothing wrote yet.
            uninitialized = info.uninitialized_output or bool(info.is_view and inputs and (
                ((src := inputs[0][2]) is not None and src[0] in self._unwritten)
                or (self._refilled and self._is_refilled(in_tensors[0]))
                or (self._partly_written and _storage_key(in_tensors[0]) in self._partly_written)
            ))
            if uninitialized:
                self._unwritten.add(index)
            if call is not None:
                call.skipped = skipped
                call.uninitialized = uninitialized
                for mode in self._before_modes:
                    try:
                        mode.before(call)
                    except Exception as failure:
                        self._detach_failed(mode, op_id, failure)
            if self._replacer is not None and call is not None:
                out = self._replacer.run(call, func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if phase in _NODE_CREATING_PHASES:
                self.modules.note_autograd_node(frame)

            rewritten: list[torch.Tensor] = []
            if info.is_collective:
                # c10d schemas do not mark what they write: an output that is an argument was written.
                # No version bump follows a collective's return (an emulated one's copy_ bumped it
                # inside): the new value is keyed by the version it has now.
                out_tensors = collective_outputs(info, args, out)
                written = [t for t in out_tensors if any(t is i for i in in_tensors)]
                rewritten = written
            else:
                out_tensors = [out] if type(out) is torch.Tensor else tensors_out(out)
                if not info.mutates:
                    written = []
                elif call is not None:
                    written = call.written()
                else:
                    written = written_tensors(info, args, kwargs)
                if written and (info.uncounted_writes or not info.counts_writes):
                    # Written without a version bump (_foreach_*, _fused_*, _amp_* ops): the new value
                    # has the old one's version, and must replace it under that key.
                    moving = (call.versions_moving() if call is not None
                              else counted_writes(info, args, kwargs))
                    rewritten = [t for t in written if not any(t is m for m in moving)]
            if written and (self._unwritten or self._partly_written):
                self._note_filling(written, in_tensors, inputs)
            if info.refills_buffers:
                for t in written:
                    base = t._base if t._base is not None else t
                    self._refilled[id(base)] = weakref.ref(base)
            # Written arguments the op does not return (running statistics, foreach
            # updates) are results too.
            if written:
                returned = tuple(out_tensors)
                for t in written:  # (loops, not any() over a generator: two calls per tensor)
                    for r in returned:
                        if t is r:
                            break
                    else:
                        out_tensors.append(t)
            try:
                if info.compiled_region:
                    outputs = self._register_region_outputs(out_tensors, in_tensors, index)
                else:
                    outputs = self.values.register_outputs(
                        out_tensors, index, info.is_view, written, rewritten)
            except UNKEYABLE_ERRORS:
                outputs, skipped_outputs = self._outputs_skipping_unkeyable(
                    out_tensors, written, index, info.is_view, rewritten
                )
                skipped += skipped_outputs
            group = None
            if call is not None:
                call.skipped = skipped
                call.outputs = outputs
                call.output_tensors = out_tensors
                if info.is_collective:
                    group = self.groups.of(info, args, kwargs)
                    if not self.pending.maybe_defer(call, out):
                        self._finish(call)
                elif not (info.is_view and self.pending.in_flight and self.pending.follow(call)):
                    self._finish(call)
            # In the order of OP_RECORD_FIELDS.
            self.records.append(
                (index, op_id, info.name, phase, origin.fqn, origin.call, origin.stack,
                 tuple(inputs), tuple(outputs), callsite, group, skipped, None,
                 self.modules.autocast if phase in _NODE_CREATING_PHASES else 0, constants, parameter)
            )
            return out
        except BaseException:
            # The op raised, or a Ctrl-C landed in a mode's per-op work: the modes may hold rows
            # for op #index already, so its record is kept (with the outputs known so far); else the
            # step's files would point past its records, and the next op would reuse the index.
            if len(self.records) == index:
                self.records.append((index, op_id, info.name, phase, origin.fqn, origin.call, origin.stack,
                                     tuple(inputs), tuple(outputs), callsite, None, skipped, None,
                                     self.modules.autocast if phase in _NODE_CREATING_PHASES else 0,
                                     constants, parameter))
            raise

    def run_dtensor_op(self, mode: TorchDispatchMode, func: Any, args: tuple, kwargs: dict,
                       dtensor: type) -> Any:
        """A DTensor op (see ``probe.tracer.dtensor_layouts``): run by DTensor's own dispatch with
        ``mode`` pushed back, so its local ops are recorded, then labelled with its layout."""
        start = len(self.records)
        records = self.records
        mode._reentering = func  # type: ignore[attr-defined]
        _push_mode(mode)
        try:
            out = func(*args, **kwargs)
        finally:
            _pop_mode()
            mode._reentering = None  # type: ignore[attr-defined]
        if records is self.records and len(records) > start:  # the same step, and it recorded ops
            self.layouts.label(records, start, self._classes[func].name, args, kwargs, out, dtensor)
        return out

    def _note_filling(self, written: list[torch.Tensor], in_tensors: list[torch.Tensor],
                      inputs: list[Any]) -> None:
        """Counts what an op wrote into buffers nothing had written before (see
        ``_partly_written``): a write into part of one leaves the rest unwritten, so a view taken
        of the rest before it is filled holds garbage (that view's statistics differed between two
        identical runs of DeepSeek-style attention, which fills a ``new_empty`` slice by slice)."""
        for t in written:
            position = next((i for i, x in enumerate(in_tensors) if x is t), None)
            if position is None:
                continue
            source = inputs[position][2]
            fresh = source is not None and source[0] in self._unwritten
            if not fresh and not self._partly_written:
                continue  # the common case: no storage looked up
            key = _storage_key(t)
            filling = self._partly_written.get(key) if key is not None else None
            if filling is None:
                if key is None or not fresh:
                    continue
                size = t.untyped_storage().nbytes() // max(t.element_size(), 1)
                filling = self._partly_written[key] = [0, size]
            filling[0] += t.numel()
            if filling[0] >= filling[1]:
                del self._partly_written[key]

    def _is_refilled(self, t: torch.Tensor) -> bool:
        known = self._refilled.get(id(t))
        return known is not None and known() is t

    def _register_region_outputs(self, results: list[torch.Tensor], inputs: list[torch.Tensor],
                                 index: int) -> list[OutputMeta]:
        """A compiled graph's results, registered: one in the memory of an input is a view of it
        the graph returns (Inductor's ``reinterpret_tensor`` of a parameter), not a write, so a
        later read of that input elsewhere in its memory still comes from where the input came
        from. Raises as ``ValueIndex.register_outputs``."""
        read = {t.untyped_storage().data_ptr() for t in inputs if t.data_ptr()}
        outputs: list[OutputMeta] = []
        for position, t in enumerate(results):
            aliases = bool(t.data_ptr()) and t.untyped_storage().data_ptr() in read
            outputs += self.values.register_outputs([t], index, aliases, [], (), first=position)
        return outputs

    def _outputs_skipping_unkeyable(
        self, results: list[torch.Tensor], written: list[torch.Tensor], index: int, view: bool,
        rewritten: list[torch.Tensor],
    ) -> tuple[list[OutputMeta], tuple[Skipped, ...]]:
        """The results' metadata when some result cannot be keyed (``register_outputs`` raised):
        each is asked :func:`unkeyable` first, those it names are skipped, the others registered
        as values op ``index`` produced. ``rewritten``: the written ones whose version counter
        does not move (see ``ValueIndex.produced``)."""
        produced = self.values.produced
        fresh_kind = "view" if view else "fresh"
        outputs: list[OutputMeta] = []
        skipped: tuple[Skipped, ...] = ()
        for position, t in enumerate(results):
            mutated = bool(written) and any(t is w for w in written)
            reason = unkeyable(t)
            if reason is not None:
                outputs.append((DTYPE_NAMES[t.dtype], _shape_of(t), mutated))
                skipped += (("out", position, reason),)
                continue
            outputs.append((DTYPE_NAMES[t.dtype], tuple(t.shape), mutated))
            kind = fresh_kind
            if mutated:
                kind = "rewritten" if rewritten and any(t is r for r in rewritten) else "written"
            produced(t, index, position, kind)
        return outputs, skipped

    def _inputs_skipping_unkeyable(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[InputMeta], tuple[Skipped, ...]]:
        """Input metadata when some input cannot be keyed: those have no source."""
        inputs: list[InputMeta] = []
        skipped: tuple[Skipped, ...] = ()
        for position, t in enumerate(tensors):
            reason = unkeyable(t)
            if reason is None:
                inputs += self.values.describe_inputs([t])
            else:
                inputs.append((DTYPE_NAMES[t.dtype], _shape_of(t), None))
                skipped += (("in", position, reason),)
        return inputs, skipped

    def _finish(self, call: OpCall) -> None:
        """The op's results are final: the modes see them, then the call lets go of its tensors."""
        for mode in self._after_modes:
            try:
                mode.after(call)
            except Exception as failure:
                self._detach_failed(mode, call.op_id, failure)
        call.release()

    def _detach_failed(self, mode: OpObserver, op_id: str, failure: Exception) -> None:
        """A passive mode's per-op work raised: the user's op is not at fault, so training must
        not see it. The mode sees no more ops in this session (its state after a failure in the
        middle of its work is not to be trusted); what it did not record is missing, never a
        guess (a reader finds those ops without its data), and every later step's manifest says
        why (``mode_failures``). ``KeyboardInterrupt`` and other ``BaseException``s still pass."""
        name = getattr(mode, "name", type(mode).__name__)
        reason = f"{type(failure).__name__} at {op_id}: {failure}"[:500]
        self.mode_failures.setdefault(name, reason)
        self._before_modes = [m for m in self._before_modes if m is not mode]
        self._after_modes = [m for m in self._after_modes if m is not mode]
        self._observed = bool(self._before_modes or self._after_modes or self._replacer)
        warn_once(f"mode-failed:{name}", f"the {name} mode failed ({reason}); it records nothing more "
                  "in this session and training goes on; each later step's manifest lists it under "
                  "'mode_failures'")


class ProbeDispatchMode(TorchDispatchMode):
    """The one dispatch mode; everything it does is delegated to a :class:`Tracer`."""

    supports_higher_order_operators = True

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self._reentering: Any = None
        """The DTensor op the tracer is running now, until its re-entry reaches this mode."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Torch would wrap __torch_dispatch__ in torch._disable_dynamo (~3 us on every op). The
        # handler's code is marked instead (probe.tracer.never_compiled: dynamo's C frame hook
        # skips it and every frame it calls, at no cost per op), and the probe's own compiled
        # kernels set their callback themselves, with the default stance (probe.compiled).
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise one traced call of a compiled function makes dynamo skip it
        # for the rest of the process.
        return True

    @never_compiled  # the eager code between a compiled model's graphs calls it
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for t in types:
            if t not in _PLAIN_TENSOR_TYPES:
                if issubclass(t, FakeTensor):
                    return func(*args, **kwargs)
                # Other subclasses (DTensor) unwrap themselves; the plain local
                # ops they issue come back through this mode. A DTensor op is run from here
                # once, to label its local ops with its placements (the re-entry of that same
                # call goes on to DTensor).
                if self._reentering is func:
                    self._reentering = None
                    return NotImplemented
                dtensor = dtensor_class()
                if dtensor is not None and self.tracer.recording and issubclass(t, dtensor):
                    return self.tracer.run_dtensor_op(self, func, args, kwargs or {}, dtensor)
                return NotImplemented
        # This mode is off the stack while its handler runs: an empty stack (one query, where
        # the two below are two) has no fake or proxy mode, which the stack's length counts.
        if _dispatch_stack_len():
            for key in _TRACING_MODE_KEYS:
                if _get_infra_mode(key) is not None:
                    return func(*args, **kwargs)
        return self.tracer.dispatch(func, args, kwargs)
