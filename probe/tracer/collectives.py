"""Collectives (``c10d.*`` and functional ``_c10d_functional.*`` ops) as the tracer sees them.

Three things differ from ordinary ops:

- **outputs**: c10d ops return ``(tensors, Work)``, nest tensor lists two deep
  (``allgather_``) or return only the ``Work`` and write their first argument
  (``allgather_into_tensor_coalesced_``, ``recv_``); :func:`collective_outputs`
  finds the written tensors either way;
- **group**: the process group (a ``ProcessGroup`` argument, or a ``group_name``
  for functional collectives) gives the group's size and global ranks, recorded
  with the op;
- **time**: an async collective's output holds its result only after the wait
  (``Work.wait``, ``wait_tensor``). The modes' ``after`` of such an op is
  deferred (:class:`PendingCollectives`) until the first op that reads the
  result runs (a correct program waits before that), or until an op that
  completes it returns (``wait_tensor``; the ``copy_`` with which gloo's emulated
  collectives fill the output); what nothing touched by the end of the step is
  waited for then. A view of the result taken before then (it reads nothing) is
  deferred with it: its values are the final result's. The probe itself never blocks earlier than the
  program does, so it cannot reorder collectives across ranks or add a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from probe.rundir.op_record_fields import GroupMeta
from probe.tracer.op_call import OpCall
from probe.vocabulary.op_class import OpClass

_WAIT_OPS = frozenset({"_c10d_functional.wait_tensor.default"})
_PURE_WRITES = frozenset({"copy_", "fill_", "zero_"})
# Wraps the pending result (in an AsyncCollectiveTensor) without reading it.
_NOT_READS = frozenset({"_c10d_functional._wrap_tensor_autograd.default"})
_NO_OUTPUT = frozenset({"send", "barrier", "monitored_barrier_", "isend"})


def _flatten(value: Any, found: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flatten(item, found)
    return found


def collective_outputs(info: OpClass, args: tuple, out: Any) -> list[torch.Tensor]:
    """The tensors a collective wrote, in schema order."""
    found = _flatten(out, [])
    if found or info.short in _NO_OUTPUT or not args:
        return found
    return _flatten(args[0], [])  # ops returning only a Work write their first argument


def _work(out: Any) -> Any:
    """The c10d ``Work`` an async collective returned, or None."""
    values = out if isinstance(out, tuple) else (out,)
    for value in values:
        if isinstance(value, torch.ScriptObject):
            try:
                return torch.distributed.Work.unbox(value)
            except (RuntimeError, AttributeError, TypeError):
                return None
    return None


class GroupCache:
    """``ProcessGroup`` argument or group name -> ``(size, name, global ranks)``, looked up once."""

    def __init__(self) -> None:
        self._known: dict[Any, GroupMeta] = {}

    def of(self, info: OpClass, args: tuple, kwargs: dict) -> GroupMeta | None:
        if info.group_arg is None:
            return None
        value = args[info.group_arg] if info.group_arg < len(args) else kwargs.get("group_name")
        if value is None:
            return None
        key = value if isinstance(value, str) else id(value)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = self._describe(value)
        return known

    @staticmethod
    def _describe(value: Any) -> GroupMeta:
        c10d = torch.distributed.distributed_c10d
        try:
            if isinstance(value, str):
                group = c10d._resolve_process_group(value)
            else:
                group = torch.distributed.ProcessGroup.unbox(value)
            ranks = tuple(torch.distributed.get_process_group_ranks(group))
            return (group.size(), str(group.group_name), ranks)
        except (RuntimeError, ValueError, AttributeError, KeyError, TypeError):
            # Not registered with this process's c10d (a group made outside it).
            return (-1, str(value) if isinstance(value, str) else "?", ())


class _Deferred:
    __slots__ = ("call", "storages", "views", "work")

    def __init__(self, call: OpCall, storages: set[int], work: Any) -> None:
        self.call, self.storages, self.work = call, storages, work
        self.views: list[OpCall] = []
        """Views of the pending result taken before it was final: their ``after`` follows the
        collective's (a view's values are the result's, which the program reads after the wait)."""


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


class PendingCollectives:
    """Async collectives whose ``after`` waits for their result to be there."""

    def __init__(self, finish: Callable[[OpCall], None]) -> None:
        self._finish = finish
        self.in_flight: dict[int, _Deferred] = {}
        """Storage pointer -> the deferred collective writing it (empty: nothing in flight;
        the tracer tests it for every op, so a plain dict, not a method)."""

    def maybe_defer(self, call: OpCall, out: Any) -> bool:
        """Defer ``call``'s ``after`` if its outputs are not final yet; whether it was deferred."""
        work = _work(out)
        if work is None and call.info.namespace == "c10d":
            return False  # a c10d op without a Work (monitored barrier): nothing in flight
        if work is not None and work.is_completed():
            return False
        if call.name in _WAIT_OPS:
            return False
        storages = {k for t in call.output_tensors or () if (k := _storage_key(t)) is not None}
        if not storages:
            return False
        call.writes_in_flight = []  # its ``after`` runs later, inside another op (or none)
        deferred = _Deferred(call, storages, work)
        for key in storages:
            earlier = self.in_flight.get(key)
            if earlier is not None:  # a second collective into the same buffer: the first is done
                self._resolve(earlier)
            self.in_flight[key] = deferred
        return True

    def follow(self, call: OpCall) -> bool:
        """Defer the ``after`` of a view op whose input is a pending result until the result is
        final; whether it was deferred."""
        for t in call.input_tensors or ():
            found = self.in_flight.get(_storage_key(t))  # type: ignore[arg-type]
            if found is not None:
                call.writes_in_flight = []  # its ``after`` runs later, inside another op (or none)
                found.views.append(call)
                return True
        return False

    def take_read_by(self, inputs: list[torch.Tensor]) -> list[_Deferred]:
        """The deferred collectives whose results ``inputs`` read (removed from the pending set)."""
        taken: list[_Deferred] = []
        for t in inputs:
            found = self.in_flight.get(_storage_key(t))  # type: ignore[arg-type]
            if found is not None and found not in taken:
                taken.append(found)
                for key in found.storages:
                    self.in_flight.pop(key, None)
        return taken

    def finish(self, taken: list[_Deferred]) -> None:
        for deferred in taken:
            self._finish_all(deferred)

    def _finish_all(self, deferred: _Deferred) -> None:
        self._finish(deferred.call)
        for view in deferred.views:
            self._finish(view)

    def _resolve(self, deferred: _Deferred) -> None:
        for key in deferred.storages:
            self.in_flight.pop(key, None)
        self._finish_all(deferred)

    def _take_all(self) -> list[_Deferred]:
        remaining = list({id(d): d for d in self.in_flight.values()}.values())
        self.in_flight.clear()
        return remaining

    def abandon(self) -> None:
        """The step failed: let go of the deferred calls without reading their outputs."""
        for deferred in self._take_all():
            deferred.call.release()
            for view in deferred.views:
                view.release()

    def drain(self) -> None:
        """End of step: wait for what nothing read, then finish it."""
        for deferred in self._take_all():
            if deferred.work is not None:
                deferred.work.wait()
            else:
                for t in deferred.call.output_tensors or ():
                    torch.ops._c10d_functional.wait_tensor(t)
            self._finish_all(deferred)

    @staticmethod
    def may_read(info: OpClass) -> bool:
        """Whether an op may read (or complete) a pending result: not views, not wrappers."""
        return not info.is_view and info.name not in _NOT_READS

    @staticmethod
    def completes(info: OpClass) -> bool:
        """Whether an op touching a pending result completes it rather than reads it: a wait,
        or a pure write (gloo's emulated collectives ``copy_`` the result into the output)."""
        return info.name in _WAIT_OPS or info.short in _PURE_WRITES or info.is_out
