"""What a replay of an untrusted run may execute, and how much memory it may take.

A replay re-executes ops named by a run's files with arguments read from them; the run may
come from anyone and may have been edited by hand. So a replay is untrusted execution, kept
to two rules, both checked before anything runs:

- **Only pure tensor computations run.** :func:`refusal` reads the op's schema and tags (once
  per overload): an op whose arguments are anything but tensors and plain values (a
  ``Storage``, a ``Stream``, a process group, an opaque object), that makes a tensor from a
  name rather than from tensors (``from_file``: a factory taking a string), that rewrites a
  tensor's storage or layout in place (``set_``, ``resize_``, tag ``inplace_view``), that
  returns no tensor and writes none (``_print``, ``_assert_async``), or that talks to other
  processes (collectives) or only profiles, is refused. Random ops are refused earlier, as
  random. Ops of other libraries run their own code: they are replayed only when the user
  imported the library (:func:`probe.vocabulary.op_class.resolve_op`).
- **Every allocation is bounded before it is made.** :func:`check_footprint` runs the recorded
  call on fake tensors (no memory, no data read) to learn the shapes it would produce; a call
  that would produce other shapes than the op's record says is refused (the recorded sizes of
  a ``repeat`` or ``new_empty`` were edited), and so is one whose inputs, outputs and
  comparison together would take more than the memory budget (a record edited to match).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from probe.errors import ProbeError
from probe.rundir.call_args import decode_args
from probe.rundir.run import OpRecord
from probe.vocabulary.op_class import OpClass, classify
from probe.vocabulary.op_tensors import results_of
from probe.vocabulary.option_values import host_memory_bytes

DEFAULT_BUDGET_FRACTION = 4
"""The default memory budget of a replay is this machine's physical memory divided by this."""
FALLBACK_MEMORY_BUDGET = 4 << 30
"""The default memory budget where the OS does not say how much memory the machine has."""
COMPARE_BYTES_PER_ELEMENT = 16
"""What comparing one output element costs at most beyond the output itself: the replayed and
the dumped value in the comparison's working dtype, float64 at most (probe.analysis.metrics)."""

_MANY = 1 << 62
"""More elements than any budget allows: where counting stops."""
# Argument kinds a pure tensor computation takes: tensors and plain values a run can record.
_PLAIN_KINDS = frozenset({
    "TensorType", "IntType", "SymIntType", "FloatType", "SymFloatType", "BoolType", "SymBoolType",
    "NumberType", "ComplexType", "StringType", "DeviceObjType", "NoneType",
})
# Ops that replace a tensor's storage or resize it (their functional forms too: ``set``,
# ``resize``): what they make is memory, not values, so there is nothing to compare.
_STORAGE_OPS = frozenset({
    "set", "set_data", "resize", "resize_as", "_resize_output", "_copy_from_and_resize",
    "sparse_resize", "sparse_resize_and_clear", "resize_as_sparse", "resize_storage_bytes",
})


class ReplayRefused(ProbeError):
    """An op the replay will not execute; ``reason`` says why (the message also names the op)."""

    def __init__(self, op: OpRecord, reason: str) -> None:
        super().__init__(f"op {op.id} ({op.name}) refused: {reason}")
        self.reason = reason


def default_memory_budget() -> int:
    """The bytes a replay may allocate for one op unless told: a quarter of physical memory."""
    host = host_memory_bytes()
    return host // DEFAULT_BUDGET_FRACTION if host else FALLBACK_MEMORY_BUDGET


def checked_budget(memory_budget: Any) -> int:
    """``memory_budget`` (bytes; None: :func:`default_memory_budget`), or a ``ProbeError``."""
    if memory_budget is None:
        return default_memory_budget()
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ProbeError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    return memory_budget


@functools.lru_cache(maxsize=4096)
def refusal(func: torch._ops.OpOverload) -> str | None:
    """Why ``func`` is not a pure tensor computation a replay may execute; None when it is."""
    info = classify(func)
    if info.passthrough:
        return "it is a metadata or profiling op, not a computation"
    if info.is_collective or info.memory_managed_outside:
        return "it works with other processes' memory (a collective): it cannot run alone"
    if torch.Tag.inplace_view in func.tags or func._opname.rstrip("_") in _STORAGE_OPS:
        return "it replaces or resizes a tensor's storage, it computes no values"
    schema = func._schema
    for arg in schema.arguments:
        kind = _unplain_kind(arg.type)
        if kind is not None:
            return f"its argument {arg.name!r} is a {kind}, not a tensor or a plain value"
    if not info.mutates and not any(_holds_tensor(r.type) for r in schema.returns):
        return "it returns no tensor and writes none: its effect is outside the tensors"
    if info.is_factory:
        named = next((a.name for a in schema.arguments if _holds_string(a.type)), None)
        if named is not None:
            return f"it makes a tensor from a name ({named!r}: a file, a key), not from tensors"
    return None


def _unplain_kind(jit_type: Any) -> str | None:
    """The kind of the first part of ``jit_type`` that is not a tensor or a plain value."""
    kind = jit_type.kind()
    if kind in ("ListType", "OptionalType"):
        return _unplain_kind(jit_type.getElementType())
    return None if kind in _PLAIN_KINDS else str(jit_type)


def _holds_string(jit_type: Any) -> bool:
    return "str" in str(jit_type)


def _holds_tensor(jit_type: Any) -> bool:
    return "Tensor" in str(jit_type)


def check_footprint(op: OpRecord, func: torch._ops.OpOverload, info: OpClass, call: dict[str, Any],
                    inputs: Sequence[torch.Tensor], dtype: torch.dtype | None, on_device: bool,
                    budget: int) -> None:
    """Refuse (:class:`ReplayRefused`) a replay of ``op`` that would make other shapes than its
    record says, or take more than ``budget`` bytes: the inputs copied for it (``inputs`` are the
    dumped ones, memory-mapped; ``dtype`` converts the floating ones; ``on_device``: copied to
    another device, from a host copy), the results, and comparing each recorded output.

    The results' shapes come from running the call on fake tensors. Where no fake kernel can
    say (an output whose size depends on the data, an op without one), the recorded outputs
    stand for the results, and each list of ints in the call (sizes, repeats) for a tensor of
    that many float64 elements: the op's result is then checked against its record after it
    ran (``probe.analysis.replay``)."""
    in_bytes = sum(t.numel() * _replayed(t.dtype, dtype).itemsize for t in inputs) * (2 if on_device else 1)
    shapes = _fake_result_shapes(func, info, call, inputs, dtype)
    if shapes is None:
        out_bytes = sum(_elements(t.shape) * _dtype_of(t.dtype, dtype).itemsize for t in op.outputs)
        out_bytes += 8 * sum(_elements(abs(n) for n in v) for v in _int_lists(call))
    else:
        for position, (shape, _) in enumerate(shapes[: len(op.outputs)]):
            recorded = tuple(op.outputs[position].shape)
            if shape != recorded:
                raise ReplayRefused(op, f"its recorded call would make output {position} of shape "
                                    f"{list(shape)}, its op record says {list(recorded)} (the call or "
                                    "the record was edited)")
        out_bytes = sum(_elements(shape) * itemsize for shape, itemsize in shapes)
    compare_bytes = sum(_elements(t.shape) * (COMPARE_BYTES_PER_ELEMENT + _dtype_of(t.dtype, None).itemsize)
                        for t in op.outputs)
    total = in_bytes + out_bytes + compare_bytes
    if total > budget:
        raise ReplayRefused(op, f"replaying it would take about {_size(total)} (inputs {_size(in_bytes)}, "
                            f"results {_size(out_bytes)}, comparison {_size(compare_bytes)}), more than "
                            f"the memory budget of {_size(budget)} (memory_budget=, --memory-budget)")


def _fake_result_shapes(func: torch._ops.OpOverload, info: OpClass, call: dict[str, Any],
                        inputs: Sequence[torch.Tensor], dtype: torch.dtype | None
                        ) -> list[tuple[tuple[int, ...], int]] | None:
    """(shape, itemsize) of each result of the call, from fake tensors; None when they cannot say."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # No fallback to real kernels: an op without a fake kernel must not run for real here.
    mode = FakeTensorMode(allow_fallback_kernels=False)
    try:
        with mode:  # a factory under the mode makes a fake tensor: shape, strides and dtype only
            fakes = [torch.empty_strided(t.shape, t.stride(), dtype=_replayed(t.dtype, dtype))
                     for t in inputs]
            args, kwargs = decode_args(call, fakes.__getitem__, device="cpu")
            results = results_of(info, args, kwargs, func(*args, **kwargs))
        return [(tuple(int(n) for n in r.shape), r.dtype.itemsize) for r in results]
    except ProbeError:
        raise
    except Exception:  # any failure of a fake kernel only means that it cannot say
        return None


def _elements(sizes: Iterable[int]) -> int:
    """The product of ``sizes``, saturated at :data:`_MANY` (a run's lists may be long and large)."""
    product = 1
    for n in sizes:
        product *= n
        if product > _MANY:
            return _MANY
    return product


def _int_lists(call: dict[str, Any]) -> list[list[int]]:
    """The lists of ints among the recorded call's arguments (sizes, repeats, shapes)."""
    values = [*call["args"], *call["kwargs"].values()]
    return [v for v in values if isinstance(v, list) and v
            and all(isinstance(n, int) and not isinstance(n, bool) for n in v)]


def _replayed(recorded: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and recorded.is_floating_point else recorded


def _dtype_of(name: str, dtype: torch.dtype | None) -> torch.dtype:
    recorded = getattr(torch, name, None)
    recorded = recorded if isinstance(recorded, torch.dtype) else torch.float64
    return _replayed(recorded, dtype)


def _size(n: int) -> str:
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n / (1 << 30):.3g} GiB" if n >= 1 << 26 else f"{n / (1 << 20):.3g} MiB"
