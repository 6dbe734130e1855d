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

from collections.abc import Callable
from typing import Any

import torch

from probe.errors import warn_once
from probe.tracer.compat import default_compile_stance

COMPILABLE_DEVICES = ("cpu", "cuda")


class CompiledKernel:
    """``fn`` compiled on first use; ``fallback`` (same signature) where that cannot work."""

    def __init__(self, fn: Callable[..., Any], fallback: Callable[..., Any] | None = None) -> None:
        self._fn = fn
        self._fallback = fallback or fn
        self._compiled: Callable[..., Any] | None = None
        self.failed_devices: set[str] = set()

    def usable(self, device: torch.device) -> bool:
        return device.type in COMPILABLE_DEVICES and device.type not in self.failed_devices

    def __call__(self, *args: torch.Tensor) -> Any:
        device = args[0].device
        if not self.usable(device):
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
                return self._compiled(*args)
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
    compiled by inductor without dynamo (``standalone_compile``), so a call runs the
    generated loop with no guard evaluation: about 15 us of host time where a
    ``torch.compile``d call costs 100 or more. Nothing checks the inputs: callers pass
    only 1-D contiguous CPU tensors of more than one element. Where compiling fails (no
    C++ compiler) a call returns None after one warning, and the caller reduces eagerly.
    """

    def __init__(self, make: Callable[[torch.dtype], Callable[[torch.Tensor], torch.Tensor]],
                 what: str) -> None:
        self._make, self._what = make, what
        self._kernels: dict[torch.dtype, Callable[..., Any] | None] = {}

    def _kernel(self, dtype: torch.dtype) -> Callable[..., Any] | None:
        if dtype in self._kernels:
            return self._kernels[dtype]
        kernel = None
        try:
            from torch.fx.experimental.proxy_tensor import make_fx

            example = [torch.zeros(64, dtype=dtype)]
            with torch.no_grad():
                graph = make_fx(self._make(dtype), tracing_mode="symbolic")(*example)
                kernel = torch._inductor.standalone_compile(graph, example)
        except Exception as e:  # any failure means the caller's eager reductions
            warn_once(f"standalone-{self._what}-{dtype}",
                      f"{self._what} kernel for {dtype} on cpu unavailable ({type(e).__name__}: {e}); "
                      "using eager reductions")
        self._kernels[dtype] = kernel
        return kernel

    def __call__(self, flat: torch.Tensor) -> torch.Tensor | None:
        """The kernel's result for ``flat``, or None where it cannot be compiled."""
        kernel = self._kernel(flat.dtype)
        if kernel is None:
            return None
        out = kernel(flat)
        return out[0] if isinstance(out, (list, tuple)) else out
