"""The probe's own ``torch.compile``d kernels: compiled once per process, never fatal.

A fused kernel (statistics, comparison metrics) is one pass over memory where
the same work in eager torch is a dozen. It is compiled lazily with dynamic
shapes, called with dynamo's default stance (the probe sets ``force_eager`` for
the user's code while it traces), and where compilation is unavailable or fails
for a device type (no C++ compiler, no Triton, an accelerator inductor does not
know) the eager fallback runs instead, after one warning.

:class:`StandaloneCpuKernel` is the hot-path form for CPU tensors: no dynamo frame and
no guards at all, for kernels called once per tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from probe.errors import warn_once
from probe.tracer.compat import default_compile_stance

COMPILABLE_DEVICES = ("cpu", "cuda")


@contextmanager
def _torch_warnings_ignored() -> Iterator[None]:
    """torch's own warnings while it compiles a kernel of the probe's (a deprecation inside the
    modules inductor imports): nothing the user can act on, and under a filter that makes
    warnings errors (pytest's ``filterwarnings = error``) they failed the compile, so the probe
    reduced eagerly for the rest of the process."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class CompiledKernel:
    """``fn`` compiled on first use; ``fallback`` (same signature) where that cannot work.

    ``compile_after``: elements (of the first argument, summed over calls) to run through the
    eager form before compiling. A compile costs seconds once per process (on a 2-core CPU with a
    cold inductor cache, 20-30 s a kernel); a kernel whose calls in a process are few and small
    (a short run, a small model) never earns that back, and one that passes billions of
    elements does within its first calls. 0: compile at the first call."""

    def __init__(self, fn: Callable[..., Any], fallback: Callable[..., Any] | None = None,
                 compile_after: int = 0) -> None:
        self._fn = fn
        self._fallback = fallback or fn
        self._eager_left = compile_after
        self._compiled: Callable[..., Any] | None = None
        self.failed_devices: set[str] = set()
        self._compiled_on: set[str] = set()
        """Device types it has run on compiled: their first compile is behind them."""

    def usable(self, device: torch.device) -> bool:
        return device.type in COMPILABLE_DEVICES and device.type not in self.failed_devices

    def __call__(self, *args: torch.Tensor) -> Any:
        device = args[0].device
        if self._eager_left > 0 or not self.usable(device):
            self._eager_left -= args[0].numel()
            with torch.no_grad():
                return self._fallback(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self._fn, dynamic=True, fullgraph=True)
        # Detached: whether an input requires grad is part of dynamo's guards, and tensors that
        # do (weights, activations) would compile every kernel twice, reaching the recompile
        # limit (8 per function) after four dtypes, which turns the kernel off for good.
        args = tuple(a.detach() for a in args)
        try:
            # Always without grad: grad mode is part of dynamo's guards, and the
            # kernels run in forward, backward and optimizer alike.
            with default_compile_stance(), torch.no_grad():
                if device.type in self._compiled_on:
                    return self._compiled(*args)
                with _torch_warnings_ignored():  # compiles: once per device type, mostly
                    out = self._compiled(*args)
                self._compiled_on.add(device.type)
                return out
        except Exception as e:  # any compile failure means "use the fallback"
            self.failed_devices.add(device.type)
            warn_once(f"compile-{self._fn.__name__}-{device.type}",
                      f"compiled kernel {self._fn.__name__} unavailable on {device.type} "
                      f"({type(e).__name__}: {e}); using its eager form")
            with torch.no_grad():  # as above: callers read the result on the host
                return self._fallback(*args)


class StandaloneCpuKernel:
    """A one-pass kernel per dtype for 1-D contiguous CPU tensors of any length.

    ``make(dtype)`` gives the function; its graph is traced with a symbolic length and
    compiled by inductor without dynamo (``standalone_compile``), and a call runs inductor's
    generated wrapper directly (found once, after compiling): no guard evaluation and none of
    the AOT wrappers' bookkeeping, about 5 us of host time where the compiled artifact's own
    call costs 10 and a ``torch.compile``d call 100 or more. Nothing checks the inputs:
    callers pass only 1-D contiguous CPU tensors of more than one element. Where compiling
    fails (no C++ compiler) a call returns None after one warning, and the caller reduces
    eagerly.

    ``parallel=True`` (:meth:`__call__`) runs a second build of the same function whose loop
    is split across torch's intra-op threads (inductor parallelizes a reduction it expects to
    be long, and traces it here with a long example); for long tensors, where it halves a
    2-thread reduction's time. Both builds' results are deterministic for a given thread count.
    """

    PARALLEL_EXAMPLE_NUMEL = 1 << 20
    # Inductor splits a loop when (its expected length / threads) reaches this; a value of its
    # own also keeps the two builds apart in inductor's cache, whose key has the config but not
    # the example's length.
    PARALLEL_MIN_CHUNK = 4096

    def __init__(self, make: Callable[[torch.dtype], Callable[[torch.Tensor], torch.Tensor]],
                 what: str) -> None:
        self._make, self._what = make, what
        self._kernels: dict[tuple[torch.dtype, bool], Callable[[torch.Tensor], Any] | None] = {}

    def _kernel(self, dtype: torch.dtype, parallel: bool) -> Callable[[torch.Tensor], Any] | None:
        key = (dtype, parallel)
        if key in self._kernels:
            return self._kernels[key]
        kernel = None
        try:
            from torch.fx.experimental.proxy_tensor import make_fx

            example = [torch.zeros(self.PARALLEL_EXAMPLE_NUMEL if parallel else 64, dtype=dtype)]
            options = {"cpp.min_chunk_size": self.PARALLEL_MIN_CHUNK} if parallel else {}
            with torch.no_grad(), torch._inductor.config.patch(options), _torch_warnings_ignored():
                graph = make_fx(self._make(dtype), tracing_mode="symbolic")(*example)
                kernel = _direct_call(torch._inductor.standalone_compile(graph, example), example[0])
        except Exception as e:  # any failure means the caller's eager reductions
            warn_once(f"standalone-{self._what}-{dtype}",
                      f"{self._what} kernel for {dtype} on cpu unavailable ({type(e).__name__}: {e}); "
                      "using eager reductions")
        self._kernels[key] = kernel
        return kernel

    def __call__(self, flat: torch.Tensor, parallel: bool = False) -> torch.Tensor | None:
        """The kernel's result for ``flat``, or None where it cannot be compiled."""
        kernel = self._kernel(flat.dtype, parallel)
        return None if kernel is None else kernel(flat)


def _direct_call(artifact: Callable[..., Any], example: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    """The fastest call of a standalone-compiled one-input, one-output kernel: inductor's
    generated ``call`` where it can be found inside ``artifact`` and gives the artifact's
    result on ``example``, else the artifact itself."""
    def through_artifact(flat: torch.Tensor) -> Any:
        out = artifact(flat)
        return out[0] if isinstance(out, (list, tuple)) else out

    runner = _generated_call(artifact)
    if runner is None:
        return through_artifact

    def direct(flat: torch.Tensor) -> Any:
        return runner([flat])[0]  # (the generated call empties the list it is given)

    try:
        probe_input = torch.arange(example.numel(), dtype=example.dtype)
        # Compared in numpy: an aten.equal here, at a kernel's first use inside a traced step,
        # looked like a host sync to the sync detectors (tests/test_no_host_sync.py).
        if np.array_equal(*(out.reshape(-1).view(torch.uint8).numpy()  # (bytes: any dtype)
                            for out in (direct(probe_input), through_artifact(probe_input)))):
            return direct
    except Exception:  # torch changed its internals: the artifact's own (slower) call
        pass
    return through_artifact


def _generated_call(artifact: Any) -> Callable[[list[torch.Tensor]], Any] | None:
    """Inductor's generated ``call(args)`` inside a ``standalone_compile`` artifact: the
    ``current_callable`` of the ``CompiledFxGraph`` its AOT wrappers close over (torch 2.6
    to 2.13), or None."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    seen: set[int] = set()
    todo: list[Any] = [getattr(artifact, "_compiled_fn", None)]
    while todo and len(seen) < 64:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            call = getattr(obj, "current_callable", None)
            return call if callable(call) and getattr(obj, "_boxed_call", False) else None
        todo += [getattr(obj, "__wrapped__", None), getattr(obj, "compiled_fn", None)]
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return None
