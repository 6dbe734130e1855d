"""The tensors of an op call: its tensor arguments, its results, and what it writes.

One home for these, used by the tracer, the modes that re-run ops (free benchmark,
upcast) and replay, so they agree on which tensors an op reads and writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from probe.vocabulary.op_class import OpClass

_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_NOT_TENSORS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format})
"""Argument types an op is called with that are no tensor and no list of them: with
``_TENSOR_TYPES``, the argument's type alone answers, without an ``isinstance`` call (this runs
for every traced op); other types (tensor subclasses, ``torch.Size``, symbolic ints) are asked."""


def tensors_in(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """Tensor arguments in schema order (aten schemas nest tensors one list deep)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()) if kwargs else args:
        kind = type(value)
        if kind in _TENSOR_TYPES:
            found.append(value)
        elif kind in _NOT_TENSORS:
            continue
        elif kind is list or kind is tuple or isinstance(value, (list, tuple)):
            for v in value:  # (a loop, not a generator: each step of one is a call)
                element = type(v)
                if element in _TENSOR_TYPES or (element not in _NOT_TENSORS and isinstance(v, torch.Tensor)):
                    found.append(v)
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


def map_arguments(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with every element of its (nested) lists and tuples replaced by ``leaf(element)``:
    how the modes that re-run an op (free benchmark, upcast) build its new arguments.

    A module function, not a closure that calls itself: such a closure is a reference cycle,
    and its cells (the op's inputs, the perturbed copies) would outlive the op until Python's
    cyclic collector runs. A gradient still referenced when autograd's AccumulateGrad takes it
    is copied into the parameter's layout instead of being kept as computed, so the ``.grad``
    of ``linalg.solve``'s column-vector right-hand side came back with other strides.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(map_arguments(v, leaf) for v in value)
    return leaf(value)


def tensors_out(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned (a tensor, or a tuple/list of them)."""
    kind = type(out)
    if kind in _TENSOR_TYPES:
        return [out]
    if kind is tuple or kind is list:
        return tensors_in(out, {})
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return tensors_in(out, {})
    return []


def written_tensors(
    info: OpClass, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> list[torch.Tensor]:
    """The tensors the schema marks as written (``Tensor(a!)``, ``Tensor(a!)[]``, ``out=``)."""
    if not info.mutates:
        return []
    values = [args[i] for i in info.mutated_args if i < len(args)]
    if kwargs:
        values += [kwargs[k] for k in info.mutated_kwargs if k in kwargs]
    return tensors_in(values, {})


def counted_writes(info: OpClass, args: Sequence[Any], kwargs: Mapping[str, Any] | None
                   ) -> list[torch.Tensor]:
    """The written tensors whose version counters autograd moves once the op returns (see
    ``OpClass.counts_writes``)."""
    if not info.counts_writes:
        return []
    if not info.uncounted_writes:
        return written_tensors(info, args, kwargs)
    values = [args[i] for i in info.mutated_args if i < len(args) and i not in info.uncounted_writes]
    if kwargs:
        values += [kwargs[k] for k in info.mutated_kwargs if k in kwargs and k not in info.uncounted_writes]
    return tensors_in(values, {})


def results_of(info: OpClass, args: Sequence[Any], kwargs: Mapping[str, Any] | None, out: Any
               ) -> list[torch.Tensor]:
    """What an op produced: its returned tensors, then the written arguments it does not return
    (running statistics, ``_foreach_*_`` updates)."""
    results = tensors_out(out)
    results += [t for t in written_tensors(info, args, kwargs) if not any(t is r for r in results)]
    return results
