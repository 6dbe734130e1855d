"""What kind of op an OpOverload is, decided once per overload and cached.

Every question the tracer and the modes ask about an op's schema (does it write
an argument, is it a view, does it allocate from nothing, is it random, is it a
collective) is answered here from the schema and tags, never per call.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from probe.errors import ProbeError

# Ops whose only effect is metadata or profiling: recording them adds noise and
# cost but no numerical information.
_METADATA_ONLY = frozenset(
    {
        "aten.sym_size.int",
        "aten.sym_stride.int",
        "aten.sym_numel.default",
        "aten.sym_storage_offset.default",
        "aten.is_contiguous.default",
        "aten.is_contiguous.memory_format",
        "aten.is_strides_like_format.default",
        "aten.is_non_overlapping_and_dense.default",
        "aten.size.default",
        "aten.stride.default",
        "aten.dim.default",
        "aten.numel.default",
        "aten.storage_offset.default",
        "aten.is_same_size.default",
        "aten.record_stream.default",
    }
)
_SKIPPED_NAMESPACES = frozenset({"profiler"})
_REGION_MARKERS = {
    "profiler._record_function_enter_new.default": 1,
    "profiler._record_function_exit._RecordFunction": -1,
}
# Ops that return memory without defined contents: their outputs have no values to inspect.
_UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)
_READS_SHAPE_ONLY = frozenset({
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
})
"""Ops that read only their tensor inputs' shape, dtype and device, never their values
(``loss.backward()`` seeds its gradient with ``ones_like(loss)``)."""
# Non-aten ops returning a buffer whose contents are written later (FSDP2's
# all-gather output, of which only this rank's shard is filled before the collective).
_UNINITIALIZED_BUFFERS = frozenset({"fsdp.all_gather_copy_in.default"})
# Ops that fill buffers the program reallocates right before each call, outside any op
# (FSDP2's unsharded parameters, a storage resize_ after each reshard): until the op
# writes them, views of those buffers hold whatever the allocator handed back.
_REFILLS_BUFFERS = frozenset({"fsdp.split_with_sizes_copy.default"})
_MEMORY_MANAGED_OUTSIDE_NAMESPACES = frozenset({"fsdp"})
# Ops that return a conjugate or negative view: the same memory, key and version as their
# input, holding other values (see ValueIndex.track_math_bits).
_MATH_BIT_VIEWS = frozenset({"aten._conj.default", "aten._neg_view.default"})
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"})


@dataclass(frozen=True, slots=True)
class OpClass:
    """Schema facts about one op overload."""

    name: str
    """Full dotted overload name, e.g. ``aten.mm.default``."""
    short: str
    """The packet name without namespace or overload, e.g. ``mm``."""
    namespace: str
    passthrough: bool
    """Run without recording: metadata-only or profiler ops."""
    mutated_args: tuple[int, ...]
    """Positional indices of arguments the schema marks as written (``Tensor(a!)``)."""
    mutated_kwargs: tuple[str, ...]
    """Keyword-only arguments marked as written (``out=``)."""
    is_view: bool
    is_inplace: bool
    is_out: bool
    is_factory: bool
    is_random: bool
    is_collective: bool
    is_host_sync: bool
    uninitialized_output: bool = False
    """The op allocates without writing (``empty*``): its outputs hold garbage."""
    reads_shape_only: bool = False
    """The op reads only its inputs' shapes, dtypes and devices (``new_zeros``, ``ones_like``)."""
    region: int = 0
    """``record_function`` markers: 1 opens a region, -1 closes one (see ModuleTracker.enter_region)."""
    group_arg: int | None = None
    """Collectives: position of the ``ProcessGroup`` (or functional ``group_name``) argument."""
    math_bit_view: bool = False
    """Returns a conjugate or negative view (``_conj``, ``_neg_view``): same memory, other values."""
    refills_buffers: bool = False
    """What the op writes are views of buffers reallocated before each of its calls, outside
    any op: a later view of such a buffer is uninitialized until the op fills it
    (``Tracer._is_refilled``)."""
    memory_managed_outside: bool = False
    """What the op writes lives in memory its caller frees and reallocates outside any op (FSDP2's
    ops: unsharded parameters, collective buffers), where no dispatch mode sees it change."""
    counts_writes: bool = False
    """Autograd adds one to the version counter of each tensor the op writes once the op
    returns, after every dispatch mode's work on it (but those of :attr:`uncounted_writes`):
    in-place and ``out=`` ops do; ``_foreach``, ``_fused_*`` (fused optimizers) and
    ``_amp_foreach_non_finite_check_and_unscale_`` ops and c10d collectives do not."""
    uncounted_writes: tuple[int | str, ...] = ()
    """Written arguments (positions, keyword names) whose writes autograd does not count in an
    op that counts others: ``_amp_update_scale_``'s growth tracker."""
    compiled_region: bool = False
    """One call of a compiled graph (``compiled="keep"``, see probe.tracer.compiled_regions): it
    cannot be re-run by the modes that re-run ops."""
    constant_args: tuple[tuple[int, str], ...] = ()
    """``(position, str(position))`` of the arguments that may hold a constant of the call (a
    number or a word: an eps, a scale, a fill value, an approximation's name), typed ``float``,
    ``Scalar``, ``str`` or ``Tensor`` (where a Python number arrives unwrapped: ``x + 1e-6``),
    and not written."""
    constant_kwargs: tuple[str, ...] = ()
    """Keyword-only arguments of those types (``alpha``, ``approximate``, ``rounding_mode``)."""
    mutates: bool = field(init=False, default=False)
    """The schema marks an argument as written (a field, not a property: it is read per op)."""
    has_constants: bool = field(init=False, default=False)
    """Any :attr:`constant_args` or :attr:`constant_kwargs` (read per op, as ``mutates``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mutates", bool(self.mutated_args or self.mutated_kwargs))
        object.__setattr__(self, "has_constants", bool(self.constant_args or self.constant_kwargs))


def _uncounted_writes(func: torch._ops.OpOverload, args: list[int], kwargs: list[str]
                      ) -> tuple[int | str, ...]:
    """The written arguments whose writes autograd's version counters do not count.

    For aten ops the ADInplaceOrView kernel, generated from the schema, bumps the version of
    each written argument the op returns, and an op without that kernel bumps none (checked on
    torch 2.13 against in-place, ``out=``, ``_foreach_*``, ``_fused_*`` and ``_amp_*`` ops).
    Other namespaces are taken to count every write (``torch.library.custom_op`` ops do)."""
    if func.namespace != "aten" or not (args or kwargs):
        return ()
    schema = func._schema
    qualified = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "ADInplaceOrView"):
        return (*args, *kwargs)
    returned: set[str] = set()
    for r in schema.returns:
        if r.alias_info is not None and r.alias_info.is_write:
            returned.update(r.alias_info.before_set)
    by_name = {a.name: a for a in schema.arguments}

    def counted(arg: torch._C.Argument) -> bool:
        return arg.alias_info is not None and bool(set(arg.alias_info.before_set) & returned)

    return (*(i for i in args if not counted(schema.arguments[i])),
            *(k for k in kwargs if not counted(by_name[k])))


_CONSTANT_TYPES = frozenset({"float", "number", "str", "Tensor"})
"""Schema types whose argument may be a constant of the call; ``Optional[...]`` of them too.
(The tracer keeps the floats and strings found there: ``probe.tracer.call_constants``.)"""


def _constant_arguments(schema: torch._C.FunctionSchema
                        ) -> tuple[tuple[tuple[int, str], ...], tuple[str, ...]]:
    """(positions, keyword-only names) of the arguments :attr:`OpClass.constant_args` describes."""
    positions: list[tuple[int, str]] = []
    names: list[str] = []
    for i, arg in enumerate(schema.arguments):
        typ = str(arg.type).removeprefix("Optional[").removesuffix("]")
        if typ not in _CONSTANT_TYPES or (arg.alias_info is not None and arg.alias_info.is_write):
            continue
        if arg.kwarg_only:
            names.append(arg.name)
        else:
            positions.append((i, str(i)))
    return tuple(positions), tuple(names)


def op_name(func: object) -> str:
    """The full dotted name of an op overload or higher-order op."""
    if isinstance(func, torch._ops.OpOverload):
        ns = func.namespace
        return f"{ns}.{func._opname}.{func._overloadname}"
    name = getattr(func, "name", None)
    if callable(name):
        name = name()
    return f"hop.{name or type(func).__name__}"


def classify(func: torch._ops.OpOverload) -> OpClass:
    """Read everything the tracer needs to know from the overload's schema."""
    schema = func._schema
    name = op_name(func)
    ns = func.namespace
    mutated_args: list[int] = []
    mutated_kwargs: list[str] = []
    any_tensor_arg = False
    is_collective = ns in _COLLECTIVE_NAMESPACES
    group_arg = None
    for i, arg in enumerate(schema.arguments):
        typ = str(arg.type)
        if "Tensor" in typ:
            any_tensor_arg = True
        if is_collective and group_arg is None and ("ProcessGroup" in typ or arg.name == "group_name"):
            group_arg = i
        alias = arg.alias_info
        if alias is not None and alias.is_write:
            if arg.kwarg_only:
                mutated_kwargs.append(arg.name)
            else:
                mutated_args.append(i)
    is_view = any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    ) and not mutated_args
    tags = set(getattr(func, "tags", ()))
    written = (bool(mutated_args or mutated_kwargs) and not is_collective
               and not func._opname.startswith("_foreach"))
    uncounted = _uncounted_writes(func, mutated_args, mutated_kwargs) if written else ()
    counts_writes = written and len(uncounted) < len(mutated_args) + len(mutated_kwargs)
    constant_args, constant_kwargs = _constant_arguments(schema)
    return OpClass(
        name=name,
        short=func._opname,
        namespace=ns,
        passthrough=name in _METADATA_ONLY or ns in _SKIPPED_NAMESPACES,
        mutated_args=tuple(mutated_args),
        mutated_kwargs=tuple(mutated_kwargs),
        is_view=is_view,
        is_inplace=bool(mutated_args) and func._opname.endswith("_"),
        is_out=bool(mutated_kwargs) and func._overloadname.startswith("out"),
        is_factory=not any_tensor_arg,
        is_random=torch.Tag.nondeterministic_seeded in tags,
        is_collective=is_collective,
        is_host_sync=name == "aten._local_scalar_dense.default",
        uninitialized_output=(
            (ns == "aten" and func._opname in _UNINITIALIZED) or name in _UNINITIALIZED_BUFFERS
        ),
        reads_shape_only=ns == "aten" and func._opname in _READS_SHAPE_ONLY,
        group_arg=group_arg,
        region=_REGION_MARKERS.get(name, 0),
        math_bit_view=name in _MATH_BIT_VIEWS,
        refills_buffers=name in _REFILLS_BUFFERS,
        memory_managed_outside=ns in _MEMORY_MANAGED_OUTSIDE_NAMESPACES,
        counts_writes=counts_writes,
        uncounted_writes=uncounted if counts_writes else (),
        constant_args=constant_args,
        constant_kwargs=constant_kwargs,
    )


def classify_higher_order(func: object) -> OpClass:
    """A higher-order op (``torch.cond``, ...): recorded as one op and run as it is."""
    name = op_name(func)
    return OpClass(
        name=name, short=name.removeprefix("hop."), namespace="hop", passthrough=False,
        mutated_args=(), mutated_kwargs=(), is_view=False, is_inplace=False, is_out=False,
        is_factory=False, is_random=False, is_collective=False, is_host_sync=False,
    )


_NAME_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default`` (any registered namespace).

    ``name`` comes from a run, which may have been edited by anyone: it is resolved strictly,
    never by walking attributes of ``torch.ops``. It must be three identifiers
    ``namespace.op.overload``, the dispatcher must hold that schema, and only then is it looked
    up, where ``torch.ops`` must give an op namespace, an ``OpOverloadPacket`` and an
    ``OpOverload`` of that very schema (``load_library.__call__.__call__`` names a method of
    ``torch.ops``, not an op; ``aten.__lshift__.Scalar`` is an op). Anything else is a
    ``ProbeError`` naming it.
    """
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 3 or not all(_NAME_PART.fullmatch(p) for p in parts):
        raise ProbeError(f"op name {name!r} is not of the form namespace.op.overload")
    namespace, packet_name, overload_name = parts
    qualified = f"{namespace}::{packet_name}"
    unregistered = ProbeError(f"op {name!r} is not registered in this process (import the library "
                              "that defines it before replaying)")
    try:
        torch._C._dispatch_find_schema_or_throw(qualified, "" if overload_name == "default"
                                                else overload_name)
    except RuntimeError:
        raise unregistered from None
    space = getattr(torch.ops, namespace, None)
    packet = getattr(space, packet_name, None) if isinstance(space, torch._ops._OpNamespace) else None
    is_packet = isinstance(packet, torch._ops.OpOverloadPacket)
    overload = getattr(packet, overload_name, None) if is_packet else None
    if not isinstance(overload, torch._ops.OpOverload) or overload._schema.name != qualified:
        raise unregistered
    return overload


@functools.lru_cache(maxsize=4096)  # bounded: the names come from runs, which may hold any number
def draws_random(name: str) -> bool | None:
    """Whether the op named ``name`` (``aten.dropout.default``) draws from torch's random
    generators; None where no op of that name is registered in this process."""
    try:
        return classify(resolve_op(name)).is_random
    except ProbeError:
        return None


@functools.lru_cache(maxsize=4096)
def probability_argument(name: str) -> tuple[int, str, float | None] | None:
    """``(position, name, default)`` of the probability a random op named ``name`` is given
    (dropout's ``p``, attention's ``dropout_p``, ``bernoulli``'s ``p``); None where it takes none
    or no op of that name is registered. Given 0, the op's results depend on no number drawn."""
    try:
        op = resolve_op(name)
    except ProbeError:
        return None
    for position, arg in enumerate(op._schema.arguments):
        if arg.name in ("p", "dropout_p") and str(arg.type) == "float":
            default = arg.default_value
            return position, arg.name, float(default) if isinstance(default, (int, float)) else None
    return None


@functools.lru_cache(maxsize=4096)
def returns_view(name: str) -> bool | None:
    """Whether the op named ``name`` (``aten.slice.Tensor``) returns a view of an input (its
    memory, not a copy); None where no op of that name is registered in this process."""
    try:
        return classify(resolve_op(name)).is_view
    except ProbeError:
        return None


def _aten_packet(name: str) -> str | None:
    """The packet of an aten op's dotted name (``aten.new_zeros.default`` -> ``new_zeros``)."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else None


def creates_uninitialized(name: str) -> bool:
    """Whether the op named ``name`` returns memory nothing has written yet (``empty_like``, ...):
    whatever it holds is no value of the program."""
    return _aten_packet(name) in _UNINITIALIZED or name in _UNINITIALIZED_BUFFERS


def reads_shape_only(name: str) -> bool:
    """Whether the op named ``name`` reads only its inputs' shapes, dtypes and devices (``new_zeros``,
    ``ones_like``): its output is a constant of the call, whatever values its inputs hold (read
    per op from :attr:`OpClass.reads_shape_only`)."""
    return _aten_packet(name) in _READS_SHAPE_ONLY


_CLASSIFIED: dict[object, OpClass] = {}
"""Every op overload classified in this process: a schema's facts do not change, so a new
session (and each ``OpClassCache``) finds the ops earlier ones met already read."""


def class_of(func: object) -> OpClass:
    """The :class:`OpClass` of an op overload or higher-order op, classified once per process."""
    info = _CLASSIFIED.get(func)
    if info is None:
        overload = isinstance(func, torch._ops.OpOverload)
        info = _CLASSIFIED[func] = classify(func) if overload else classify_higher_order(func)
    return info


class OpClassCache(dict):
    """``func -> OpClass``; a miss looks the op up in the process-wide table (:func:`class_of`).

    ``by_id`` holds the same classes keyed by ``id(func)``: an ``OpOverload`` hashes in Python
    (a function call per dict lookup), an int does not; the funcs stay alive as this dict's
    keys, so their ids are not reused. ``on_math_bit_view`` is called when an op that makes
    conjugate or negative views first enters this cache, i.e. before the first such view exists
    in the traced program.
    """

    def __init__(self, on_math_bit_view: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._on_math_bit_view = on_math_bit_view
        self.by_id: dict[int, OpClass] = {}

    def __missing__(self, func: object) -> OpClass:
        return self.add(func, class_of(func))

    def add(self, func: object, info: OpClass) -> OpClass:
        """Hold ``info`` as ``func``'s class (a compiled region's, made by its caller)."""
        self[func] = info
        self.by_id[id(func)] = info
        if info.math_bit_view and self._on_math_bit_view is not None:
            self._on_math_bit_view()
        return info
