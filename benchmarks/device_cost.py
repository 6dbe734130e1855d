"""A device cost model that runs on the CPU: what the statistics engine issues on an accelerator.

The engine (``probe.modes.statistics``) branches on the device: CPU tensors go through the
generated host loops, accelerator tensors through ``device_rows``, ``TensorStats.row`` and the
staging chunks. This model runs the accelerator branch for real on ``meta`` tensors (shapes,
dtypes and strides, no memory and no values: any size fits), with ``meta`` given what the engine
asks of CUDA (fp64 accumulation, ``reduce.FP64_DEVICES``; the compiled kernels,
``compiled.COMPILABLE_DEVICES``), and counts every aten op the engine issues there:

- **launches**: ops that run a kernel (views, ``empty`` and other metadata ops launch nothing);
- **bytes read**: the bytes of every device tensor an op takes (a view counts its own elements);
- **bytes written**: the bytes of every device tensor an op returns or writes;
- **host syncs**: ops the host must wait for (``item``, a copy to the CPU, ``nonzero`` and the
  other data-dependent shapes).

The probe's compiled kernels (``probe.compiled.CompiledKernel``) cannot run on a simulated
device: each call is counted as what Inductor makes of it, one fused pass that reads each input
once and writes its outputs, and its outputs' shapes come from its eager form. Everything else
is the engine's own code, unchanged.

A workload is one training step of a model on ``meta`` (forward, backward, AdamW with torch's
default for CUDA tensors, ``foreach=True``) whose tensors reach the engine as the stats mode
hands them over: every op's non-view outputs, and each value from outside the step (weights,
optimizer state, data) once, read at once where the op writes it (``StepRows.add(now=True)``);
queued tensors are reduced before an op writes them (``before_write``), when the queue's budget
is spent (``settle``) and at the step's end. The per-step totals are divided by the bytes and
the number of the values reduced.

:func:`session_step_cost` runs the real thing instead: a ``probe.mode("stats")`` session over
two training steps on ``meta`` (the second counted), the tracer, the stats mode's hand-over,
its optimizer-step handling and the engine unchanged. Meta tensors are given addresses (the
tracer keys values by address); the counter attributes each op by the Python stack: an op the
probe's code issued is counted with that code's chain of functions, the program's own ops
(which the tracer passes through) are not. CUDA-only behaviour the model adds: a reduction CUDA
widens in a copy first (``_WIDENING_REDUCTIONS``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

import probe
import probe.compiled
from probe.compiled import CompiledKernel
from probe.modes.statistics import reduce, sketch
from probe.modes.statistics.capture import PendingRows, StepRows
from probe.modes.statistics.reduce import TensorStats, as_real, compact_view
from probe.modes.statistics.strided import strided_layout

DEVICE = torch.device("meta")
"""Where the model runs the engine's accelerator branch."""

# Ops that allocate or reinterpret memory without running a kernel.
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view",
    "lift_fresh", "lift_fresh_copy", "detach", "alias", "set_", "resize_", "_reshape_alias",
})
# Ops whose result the host must read before it can go on.
_HOST_SYNCS = frozenset({
    "_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "is_nonzero", "equal", "repeat_interleave", "bincount", "histc",
    "_assert_async", "allclose",
})


# Reductions whose CUDA kernel widens its input to the output dtype in a copy first (ATen's
# ``make_reduction_from_out_ty``: only fp16/bf16 -> fp32 is read as it is): ``x.sum(dtype=fp64)``
# of a bf16 tensor writes an fp64 copy of it, ``isnan(x).sum()`` an int64 copy of the mask, and
# ``count_nonzero`` is such a sum on CUDA (``(x != 0).sum()``). No dispatch mode sees that copy
# (it is made inside the kernel), so the model adds it.
_WIDENING_REDUCTIONS = frozenset({"sum", "mean", "nansum", "prod", "count_nonzero"})
_READ_AS_IS = frozenset({(torch.float16, torch.float32), (torch.bfloat16, torch.float32)})


def _widening_copy(name: str, args: Any, out: Any) -> tuple[int, int]:
    """(bytes read, bytes written) of the copy CUDA makes inside reduction ``name``, or (0, 0)."""
    if name not in _WIDENING_REDUCTIONS or not args or not isinstance(out, torch.Tensor):
        return 0, 0
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.device != DEVICE or x.dtype == out.dtype \
            or (x.dtype, out.dtype) in _READ_AS_IS:
        return 0, 0
    # (count_nonzero of a non-bool tensor also writes its mask first: one byte a value)
    mask = x.numel() if name == "count_nonzero" and x.dtype != torch.bool else 0
    return x.numel() * x.element_size(), x.numel() * out.element_size() + mask


def _device_bytes(tensors: list[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor) and t.device == DEVICE)


def _is_view(func: torch._ops.OpOverload) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class OpCost:
    """One op the engine issued on the device."""

    name: str
    read: int
    written: int
    launches: int
    syncs: int
    caller: str = ""
    """The probe code that issued it (:func:`probe_caller`); "" where the engine was run
    directly (:func:`stats_step_cost`)."""

    @property
    def issuer(self) -> str:
        """The probe function that issued it (the innermost of :attr:`caller`)."""
        return self.caller.rsplit(" > ", 1)[-1]


@dataclass
class Tally:
    """The engine's device work over a step, and the values it reduced."""

    ops: list[OpCost] = field(default_factory=list)
    values: int = 0
    """Tensors reduced (one raw row each)."""
    value_bytes: int = 0
    """Their bytes, as stored (a broadcast view's distinct elements once)."""

    @property
    def read(self) -> int:
        return sum(op.read for op in self.ops)

    @property
    def written(self) -> int:
        return sum(op.written for op in self.ops)

    @property
    def launches(self) -> int:
        return sum(op.launches for op in self.ops)

    @property
    def syncs(self) -> int:
        return sum(op.syncs for op in self.ops)

    def by_op(self) -> dict[str, OpCost]:
        """Totals per op name, largest bytes first."""
        out: dict[str, OpCost] = {}
        for op in self.ops:
            total = out.setdefault(op.name, OpCost(op.name, 0, 0, 0, 0))
            total.read += op.read
            total.written += op.written
            total.launches += op.launches
            total.syncs += op.syncs
        return dict(sorted(out.items(), key=lambda kv: -(kv[1].read + kv[1].written)))

    def by_caller(self) -> list[OpCost]:
        """Totals per (op name, probe caller), largest bytes first, then most launches."""
        out: dict[tuple[str, str], OpCost] = {}
        for op in self.ops:
            total = out.setdefault((op.name, op.caller), OpCost(op.name, 0, 0, 0, 0, op.caller))
            total.read += op.read
            total.written += op.written
            total.launches += op.launches
            total.syncs += op.syncs
        return sorted(out.values(), key=lambda op: (-(op.read + op.written), -op.launches))


_PROBE_DIR = os.path.dirname(probe.__file__) + os.sep
_TRACER_DISPATCH = os.path.join(_PROBE_DIR, "tracer", "dispatch_mode.py")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _probe_name(frame: Any) -> str:
    return f"{frame.f_code.co_filename[len(_PROBE_DIR):].removeprefix('modes/')}:{frame.f_code.co_name}"


def probe_caller(func: Any, frame: Any) -> str | None:
    """The probe code that issued ``func``, walking up from ``frame``: the probe function where
    the probe was entered (the stats mode's ``before``, the session's ``step``), then each
    function called on the way to the op, ``"stats/mode.py:before > add > row"``; None for the
    program's own op, which the tracer passes through (its frame holds ``func``) on its way from
    code outside the probe."""
    chain: list[Any] = []
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == _TRACER_DISPATCH:
            if chain:
                break  # the tracer called the probe code above (a mode's handler)
            if frame.f_locals.get("func") is not func:
                chain.append(frame)  # the tracer's own op
            # else the tracer runs the op: whose it is, the code above says
        elif filename.startswith(_PROBE_DIR):
            if not frame.f_code.co_name.startswith("<"):  # (a comprehension's frame)
                chain.append(frame)
        elif not filename.startswith(_TORCH_DIR) and filename != __file__:
            break  # the program's code (a model, an optimizer's caller)
        frame = frame.f_back
    if not chain:
        return None
    return " > ".join([_probe_name(chain[-1]), *(f.f_code.co_name for f in reversed(chain[:-1]))])


class DeviceCostMode(TorchDispatchMode):
    """Sees every op; while :meth:`engine` is active, counts each in :attr:`tally`."""

    def __init__(self) -> None:
        super().__init__()
        self.tally = Tally()
        self.counting = 0
        self.silent = False
        self._program_keys: tuple[Any, Any] | None = None
        """The dispatch keys of code run under this mode (taken when it is first entered)."""
        """Ops neither counted nor handed over (a modelled kernel's eager form)."""
        self.on_op: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None] | None = None
        """Called with each op of the program (not the engine's) after it ran: the workload's
        hand-over to the engine."""
        self.before_op: Callable[[Any, tuple[Any, ...], dict[str, Any]], None] | None = None
        self.attribute = False
        """Count the ops whose caller (:func:`probe_caller`) is the probe, each with its caller
        (a real session runs: :func:`session_step_cost`)."""
        self.caller = ""

    def __enter__(self) -> DeviceCostMode:
        entered = super().__enter__()
        if self._program_keys is None:
            self._program_keys = (torch._C._dispatch_tls_local_include_set(),
                                  torch._C._dispatch_tls_local_exclude_set())
        return entered

    @contextlib.contextmanager
    def engine(self) -> Iterator[None]:
        """The statistics engine runs: count its ops (with this mode entered again: a program's
        op calls the engine from inside this mode's dispatch, where the mode is off)."""
        self.counting += 1
        entered = self in _get_current_dispatch_mode_stack()
        try:
            # Inside this mode's dispatch the dispatcher skips the keys above it (autograd's):
            # composite ops such as ``Tensor.to`` would reach their kernels unseen. The engine
            # runs with the dispatch keys of the program's own code.
            with contextlib.nullcontext() if entered else self, \
                    torch._C._ForceDispatchKeyGuard(*self._program_keys):
                yield
        finally:
            self.counting -= 1

    def count(self, name: str, inputs: list[Any], outputs: list[Any], launches: int = 1) -> None:
        self.tally.ops.append(OpCost(name, _device_bytes(inputs), _device_bytes(outputs), launches, 0,
                                     self.caller))

    def count_call(self, name: str, inputs: list[Any], outputs: list[Any], frame: Any,
                   launches: int = 1) -> None:
        """Count a modelled kernel call (no aten op this mode sees) made from ``frame``: in a
        session, only where probe code made it; elsewhere while the engine runs."""
        if self.attribute:
            caller = probe_caller(None, frame)
            if caller is not None:
                self.caller = caller
                self.count(name, inputs, outputs, launches)
        elif self.counting:
            self.count(name, inputs, outputs, launches)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.silent:
            return func(*args, **kwargs)
        if self.attribute:
            out = func(*args, **kwargs)
            caller = probe_caller(func, sys._getframe(1))
            if caller is not None:
                self.caller = caller
                self._count(func, args, kwargs, out)
            return out
        if self.counting == 0 and self.before_op is not None:
            self.before_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.counting:
            self._count(func, args, kwargs, out)
        elif self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out

    def _count(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        name = func.overloadpacket.__name__
        inputs, _ = tree_flatten((args, kwargs))
        outputs, _ = tree_flatten(out)
        if name in _HOST_SYNCS:
            self.tally.ops.append(OpCost(name, _device_bytes(inputs), 0, 1, 1, self.caller))
            return
        if name in _NO_KERNEL or _is_view(func):
            return
        if name in ("_to_copy", "copy_", "to") and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                       for t in outputs):
            if _device_bytes(inputs):  # to the host: a blocking transfer
                self.tally.ops.append(OpCost(f"{name} (to host)", _device_bytes(inputs), 0, 1, 1,
                                             self.caller))
            return
        written = _device_bytes(outputs)
        if not written and not _device_bytes(inputs):
            return  # host-only work
        read, widened = _widening_copy(name, args, out)
        if widened:
            self.tally.ops.append(OpCost(f"copy_ (widens inside {name})", read, widened, 1, 0, self.caller))
        self.tally.ops.append(OpCost(name, _device_bytes(inputs), written, 1, 0, self.caller))


@contextlib.contextmanager
def _accelerator_path(mode: DeviceCostMode, multi_tensor: bool = True) -> Iterator[None]:
    """``meta`` taken for CUDA by the engine, each compiled kernel call counted as one fused
    pass, and each multi-tensor kernel call as one pass and :data:`MULTI_TENSOR_LAUNCHES`
    launches (see the module docstring). ``multi_tensor=False``: CUDA without Triton."""
    original = CompiledKernel.__call__
    devices, fp64 = probe.compiled.COMPILABLE_DEVICES, reduce.FP64_DEVICES

    def modelled(kernel: CompiledKernel, *args: torch.Tensor) -> Any:
        silent, mode.silent = mode.silent, True
        try:
            with torch.no_grad():
                out = kernel._fallback(*args)
        finally:
            mode.silent = silent
        mode.count_call(f"compiled {kernel._fn.__name__}", list(args), tree_flatten(out)[0], sys._getframe(1))
        return out

    def modelled_rows(xs: list[torch.Tensor], threshold: float, signs: Any = None) -> torch.Tensor:
        # The multi-tensor kernel (CUDA with Triton): one pass reading each tensor once (with a
        # sketch pattern's signs, sketch=True: those small tables too, each row followed by the
        # value's sketch) and a launch folding the partials, after one host-to-device copy of the
        # address table.
        for i, x in enumerate(xs):  # what the kernel refuses, refused here too
            reordered = signs is not None and signs.reordered(i)
            if (not x.is_contiguous() or reordered) and strided_layout(x) is None:
                raise ValueError(f"multi_tensor.rows: {tuple(x.shape)} {x.stride()} is not strided")
        width = reduce.WIDTH + (0 if signs is None else sketch.SKETCHES)
        silent, mode.silent = mode.silent, True
        try:
            out = torch.empty((len(xs), width), dtype=torch.float64, device=xs[0].device)
        finally:
            mode.silent = silent
        read = list(xs) if signs is None else [*xs, signs.columns, signs.blocks]
        mode.count_call("multi-tensor rows", read, [out], sys._getframe(1), MULTI_TENSOR_LAUNCHES)
        return out

    CompiledKernel.__call__ = modelled  # type: ignore[method-assign]
    probe.compiled.COMPILABLE_DEVICES = (*devices, DEVICE.type)
    reduce.FP64_DEVICES = (*fp64, DEVICE.type)
    multi_devices = reduce.MULTI_TENSOR_DEVICES
    reduce.MULTI_TENSOR_DEVICES = (*multi_devices, DEVICE.type)
    try:
        with reduce.multi_tensor_kernel_replaced(modelled_rows if multi_tensor else None):
            yield
    finally:
        CompiledKernel.__call__ = original  # type: ignore[method-assign]
        probe.compiled.COMPILABLE_DEVICES, reduce.FP64_DEVICES = devices, fp64
        reduce.MULTI_TENSOR_DEVICES = multi_devices


class StatsHandOver:
    """Hands a program's tensors to a :class:`StepRows` as the stats mode does (see the module
    docstring), with the engine's ops counted."""

    def __init__(self, mode: DeviceCostMode, rows: StepRows) -> None:
        self.mode, self.rows = mode, rows
        self.produced: set[int] = set()
        """Storages an op of the step wrote: their values are some op's output."""
        self.external: set[tuple[int, int, int, int]] = set()
        self.storages: dict[int, torch.UntypedStorage] = {}  # keeps their ids unique

    def add(self, t: torch.Tensor, **options: Any) -> None:
        x, _ = compact_view(as_real(t))
        with self.mode.engine():
            row = self.rows.add(t, **options)
        if row is not None and x.numel():
            self.mode.tally.values += 1
            self.mode.tally.value_bytes += x.numel() * x.element_size()

    def before_op(self, func: Any, args: Any, kwargs: Any) -> None:
        with self.mode.engine():
            if self.rows.due:
                self.rows.settle()
        schema = func._schema
        written = []
        for argument, value in zip(schema.arguments, [*args, *[kwargs.get(a.name) for a in
                                                            schema.arguments[len(args):]]], strict=False):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written.extend(t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))
        if written:
            with self.mode.engine():
                self.rows.before_write(written)
        writes = {t.untyped_storage()._cdata for t in written}
        overwrites = func.overloadpacket.__name__ in ("copy_", "fill_", "zero_", "_foreach_copy_")
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t.device != DEVICE or not t.numel():
                continue
            storage = t.untyped_storage()
            if storage._cdata in self.produced or (overwrites and storage._cdata in writes):
                continue
            key = (storage._cdata, t.storage_offset(), t._version, t.numel())  # a weight and its .t() alike
            if key in self.external:
                continue
            self.external.add(key)
            self.storages[storage._cdata] = storage
            self.add(t, now=storage._cdata in writes)

    def after_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if _is_view(func) or func.overloadpacket.__name__ in _NO_KERNEL:
            return
        mutated = func._schema.is_mutable
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == DEVICE and t.numel():
                storage = t.untyped_storage()
                self.produced.add(storage._cdata)
                self.storages[storage._cdata] = storage
                self.add(t, version_moves=mutated)


def stats_step_cost(model: torch.nn.Module, batch: Callable[[], Any],
                    loss: Callable[[torch.nn.Module, Any], torch.Tensor], stage: bool = True,
                    eps: float | None = None, multi_tensor: bool = True) -> Tally:
    """The engine's device work over one training step of ``model`` (on ``meta``) on the batch
    ``batch()`` makes (called with ``meta`` as the
    default), with AdamW (``foreach=True``, CUDA's default), as the stats mode would hand its
    tensors over. ``stage=False``: small tensors queued with the others (the monitor across
    ranks, a ``stats_backend`` other than "auto"); ``eps``: count zeros (the monitor's);
    ``multi_tensor=False``: CUDA without Triton (no multi-tensor kernel)."""
    mode = DeviceCostMode()
    rows = StepRows(TensorStats("auto"), stage=stage, saturation="auto", eps=eps)
    hand_over = StatsHandOver(mode, rows)
    with mode, torch.device(DEVICE), _accelerator_path(mode, multi_tensor):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        inputs = batch()
        mode.before_op, mode.on_op = hand_over.before_op, hand_over.after_op
        loss(model, inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mode.before_op = mode.on_op = None
        with mode.engine():
            rows.end_step()
    return mode.tally


# -- the real stats mode session -----------------------------------------------------------


@contextlib.contextmanager
def _meta_addresses() -> Iterator[None]:
    """Meta tensors given addresses: each storage its own range (from its ``StorageImpl``
    address), so that the tracer keys their values and the queue checks them as it does real
    memory (a meta tensor's ``data_ptr`` is 0: the tracer would skip it as memory-less)."""
    tensor_ptr, storage_ptr = torch.Tensor.data_ptr, torch.UntypedStorage.data_ptr

    def tensor_address(t: torch.Tensor) -> int:
        if t.device.type != DEVICE.type:
            return tensor_ptr(t)
        return (t.untyped_storage()._cdata << 40) + t.storage_offset() * t.element_size()

    def storage_address(s: torch.UntypedStorage) -> int:
        return (s._cdata << 40) if s.device.type == DEVICE.type else storage_ptr(s)

    torch.Tensor.data_ptr = tensor_address  # type: ignore[method-assign]
    torch.UntypedStorage.data_ptr = storage_address  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.data_ptr = tensor_ptr  # type: ignore[method-assign]
        torch.UntypedStorage.data_ptr = storage_ptr  # type: ignore[method-assign]


@contextlib.contextmanager
def _fused_optimizers_on_meta() -> Iterator[None]:
    """``fused=True`` optimizers accept ``meta`` parameters (their ops have meta kernels)."""
    import torch.optim.optimizer as optimizer_module

    supported = optimizer_module._get_fused_kernels_supported_devices
    optimizer_module._get_fused_kernels_supported_devices = lambda: [*supported(), DEVICE.type]
    try:
        yield
    finally:
        optimizer_module._get_fused_kernels_supported_devices = supported


@contextlib.contextmanager
def _values_counted(mode: DeviceCostMode) -> Iterator[None]:
    """Each tensor a :class:`StepRows` gives a row with values counted in ``mode.tally``, and the
    writer thread's transfer left out: meta rows have no values to read (their rows come back
    NaN; the step's one transfer is outside the training step)."""
    add, add_row, to_host = StepRows.add, StepRows.add_row, PendingRows.to_host
    sketchable, sketches_to_host = sketch.sketchable, sketch.PendingSketches.to_host

    def counted_add(rows: StepRows, t: torch.Tensor, *args: Any, **kwargs: Any) -> int | None:
        row = add(rows, t, *args, **kwargs)
        x, _ = compact_view(as_real(t))
        if row is not None and x.numel() and not mode.silent:
            mode.tally.values += 1
            mode.tally.value_bytes += x.numel() * x.element_size()
        return row

    def counted_add_row(rows: StepRows, row: torch.Tensor, numel: int) -> int:
        mode.tally.values += 1
        mode.tally.value_bytes += numel * 4  # (an update Adam took, read from its fp32 moments)
        return add_row(rows, row, numel)

    def nan_rows(pending: PendingRows) -> tuple[Any, Any, Any]:
        import numpy as np

        table = np.array(pending.rows, dtype=np.int64).reshape(len(pending.rows), 4)
        return np.full((len(table), reduce.WIDTH), np.nan), table[:, 2], table[:, 3]

    def nan_sketches(pending: sketch.PendingSketches, rows: int) -> Any:
        import numpy as np

        return np.full((rows, sketch.SKETCHES), np.nan)

    StepRows.add, StepRows.add_row = counted_add, counted_add_row  # type: ignore[method-assign]
    PendingRows.to_host = nan_rows  # type: ignore[method-assign]
    # sketch=True: meta values sketched as the device's would be (their projections NaN on the host).
    sketch.sketchable = lambda t: sketchable(t) or (t.is_meta and (t.is_floating_point() or t.is_complex())
                                                    and t.numel() > 0)
    sketch.PendingSketches.to_host = nan_sketches  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepRows.add, StepRows.add_row, PendingRows.to_host = add, add_row, to_host  # type: ignore[method-assign]
        sketch.sketchable, sketch.PendingSketches.to_host = sketchable, sketches_to_host  # type: ignore[method-assign]


OPTIMIZERS = ("foreach", "fused")
"""AdamW's implementations the session cost is measured with (CUDA's default is foreach)."""


def session_step_cost(model: torch.nn.Module, batch: Callable[[], Any],
                      loss: Callable[[torch.nn.Module, Any], torch.Tensor], optimizer: str = "foreach",
                      multi_tensor: bool = True, **options: Any) -> Tally:
    """The device work the probe itself issues over one training step of ``model`` (on ``meta``)
    under a real ``probe.mode("stats", **options)`` session: the tracer, the stats mode and its
    engine, each op with the probe function that issued it (the program's own ops are not
    counted). The second of two steps is counted (the first makes AdamW's state).
    ``optimizer``: AdamW ``"foreach"`` or ``"fused"``; ``multi_tensor=False``: CUDA without Triton."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {optimizer!r}")
    mode = DeviceCostMode()
    mode.attribute = True
    out = tempfile.mkdtemp(prefix="device-cost-")
    with _meta_addresses(), _fused_optimizers_on_meta(), mode, torch.device(DEVICE), \
            _accelerator_path(mode, multi_tensor), _values_counted(mode):
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer: True})
        with probe.mode("stats", out=out, overwrite=True, model=model, **options) as session:
            for step in range(2):
                if step:
                    mode.tally = Tally()
                loss(model, batch()).backward()
                adamw.step()
                adamw.zero_grad(set_to_none=True)
                session.step()
            tally = mode.tally
            mode.attribute = False
    return tally


def hf_llama(shape: tuple[str, int, int, int, int, int, int, int, str], dtype: torch.dtype
             ) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """``benchmarks.workloads``' HF Llama of ``shape`` in ``dtype`` on ``meta`` (no initialisation
    work), and its batch of tokens."""
    import transformers

    _, hidden, inter, layers, heads, vocab, batch, seq, attention = shape
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        attn_implementation=attention)
    with torch.device(DEVICE):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model, lambda: torch.zeros((batch, seq + 1), dtype=torch.long)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


# -- the budget (issue 35) -------------------------------------------------------------------

READ_BUDGET = 1.1
"""Bytes read by the engine per byte of the values it reduces."""
WRITTEN_BUDGET = 0.01
"""Bytes written per byte reduced."""
MULTI_TENSOR_LAUNCHES = 3
"""A multi-tensor kernel call: the address table's host-to-device copy, the pass, the fold."""

VALUES_PER_LAUNCH = 32
BYTES_PER_LAUNCH = 64 << 20
"""Launches: one per 32 values reduced, plus one per 64 MiB of them (a large tensor's pass)."""


@dataclass(frozen=True)
class Budget:
    """A tally against the budget: each figure, its limit, and whether it is met."""

    name: str
    value: float
    limit: float

    @property
    def met(self) -> bool:
        return self.value <= self.limit


def launch_budget(tally: Tally) -> float:
    """The launches the budget allows for the values of ``tally``."""
    return tally.values / VALUES_PER_LAUNCH + tally.value_bytes / BYTES_PER_LAUNCH


def budgets(tally: Tally) -> list[Budget]:
    """The issue's four budgets for one step's tally."""
    launches = launch_budget(tally)
    return [
        Budget("bytes read / bytes reduced", tally.read / tally.value_bytes, READ_BUDGET),
        Budget("bytes written / bytes reduced", tally.written / tally.value_bytes, WRITTEN_BUDGET),
        Budget("launches / budgeted launches", tally.launches / launches, 1.0),
        Budget("host syncs", tally.syncs, 0),
    ]
