"""``compiled="keep"``: each call of a compiled graph recorded as one op, its kernels untraced.

Inductor's fused kernels never reach the dispatcher, so a dispatch mode sees only the extern
kernels (``aten.mm.out``, ...) a compiled graph calls. Under ``compiled="keep"`` the probe
records instead one *region op* per call of an Inductor graph (its forward, its backward, or
its inference graph): named ``compiled.<function>`` after the function dynamo compiled (a
module's is ``compiled.<Class>.forward``), attributed to the module call it runs in, its
inputs the graph's tensor arguments and its outputs the graph's tensor results, so that stats
and dump see what went in and out. The graph runs as it is, with the dispatch mode off: the
ops it issues inside are not recorded (neither are the probe's own compiled
kernels). Modes that must re-run an op (free benchmark, upcast) leave region ops alone.

A forward graph's outputs are what the graph returns: the function's results, then the
activations it saves for its backward (whose inputs they are, so the run links them). The
backward region carries the forward's name, phase ``backward``.

The hook is ``CompiledFxGraph.__call__``, a torch internal: :func:`region_hook_target` probes
for it once, and where it is missing (another torch; a backend other than Inductor is never
seen) compiled code runs unrecorded as before, after one warning.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode,
    _get_current_dispatch_mode_stack,
    _pop_mode_temporarily,
)

from probe.errors import warn_once
from probe.vocabulary.op_class import OpClass

_EVAL_FRAME_FILE = ("_dynamo/eval_frame.py", "_dynamo\\eval_frame.py")
_MODULE_CALL_FILE = ("nn/modules/module.py", "nn\\modules\\module.py")


def region_hook_target() -> type | None:
    """The class whose ``__call__`` runs one compiled graph (Inductor's ``CompiledFxGraph``), or
    None where this torch has none of that shape."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except Exception:  # pragma: no cover - another torch, or no inductor
        return None
    return CompiledFxGraph if "__call__" in vars(CompiledFxGraph) else None


def region_op_class(name: str) -> OpClass:
    """The op class of a compiled region: not re-runnable, never a view, a factory or random."""
    return OpClass(
        name=name, short=name.removeprefix("compiled."), namespace="compiled", passthrough=False,
        mutated_args=(), mutated_kwargs=(), is_view=False, is_inplace=False, is_out=False,
        is_factory=False, is_random=False, is_collective=False, is_host_sync=False,
        compiled_region=True,
    )


def _compiled_function_name() -> str | None:
    """The qualified name of the function whose dynamo-compiled frame called the running graph.

    Dynamo calls a graph through a ``disable``d wrapper (``_fn`` in ``eval_frame.py``); the frame
    that called that wrapper is the compiled function's own. None when no such frame is on the
    stack (a backward graph runs from the autograd engine)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_fn" and code.co_filename.endswith(_EVAL_FRAME_FILE):
            caller = frame.f_back
            if caller is None:
                return None
            code = caller.f_code
            if code.co_filename.endswith(_MODULE_CALL_FILE):
                # torch.compile(module) compiles Module.__call__: name the module's class.
                module = caller.f_locals.get("self")
                return f"{type(module).__name__}.forward" if module is not None else "forward"
            return getattr(code, "co_qualname", code.co_name).rpartition("<locals>.")[2]
        frame = frame.f_back
    return None


class RegionCall:
    """One compiled graph as the tracer's ``func``: calling it runs the graph unrecorded."""

    __slots__ = ("_run", "graph", "info")

    def __init__(self, graph: Any, info: OpClass, run: Callable[[Any, list[Any]], Any]) -> None:
        self.graph = graph
        self.info = info
        self._run = run

    def __call__(self, inputs: list[Any]) -> Any:
        return self._run(self.graph, inputs)


class RegionCalls:
    """A :class:`RegionCall` per graph, made when it first runs in the session (and holding it,
    so its id stays its own). A forward or inference graph is named after the function whose
    frame called it; a backward graph takes the name of the forward graph of its AOT graph id."""

    def __init__(self, run: Callable[[Any, list[Any]], Any]) -> None:
        self._run = run
        self._by_graph: dict[int, RegionCall] = {}
        self._forward_names: dict[Any, OpClass] = {}

    def of(self, graph: Any) -> RegionCall:
        region = self._by_graph.get(id(graph))
        if region is None:
            region = self._by_graph[id(graph)] = RegionCall(graph, self._name(graph), self._run)
        return region

    def _name(self, graph: Any) -> OpClass:
        fx_kwargs = getattr(graph, "fx_kwargs", None) or {}
        graph_id = fx_kwargs.get("graph_id")
        if fx_kwargs.get("is_backward") and graph_id in self._forward_names:
            return self._forward_names[graph_id]
        function = _compiled_function_name()
        info = region_op_class(f"compiled.{function or f'graph{graph_id}'}")
        if graph_id is not None and not fx_kwargs.get("is_backward"):
            self._forward_names[graph_id] = info
        return info


@contextmanager
def compiled_regions_recorded() -> Iterator[None]:
    """While active, each call of a compiled graph made under the probe's dispatch mode is
    recorded as one region op (see the module docstring)."""
    target = region_hook_target()
    if target is None:
        warn_once("compiled-regions", "this torch has no hook for compiled graphs (Inductor's "
                  "CompiledFxGraph); compiled regions run compiled but are not recorded as ops, "
                  "only the extern kernels they call are")
        yield
        return
    from probe.tracer.dispatch_mode import ProbeDispatchMode

    original: Callable[[Any, list[Any]], Any] = target.__call__
    regions = RegionCalls(original)

    def call_recorded(graph: Any, inputs: list[Any]) -> Any:
        mode = _get_current_dispatch_mode()
        if isinstance(mode, ProbeDispatchMode):
            # The modes' work (and the graph) run with the dispatch mode off, as inside a dispatch.
            modes_off = _pop_mode_temporarily
        else:
            # A graph's first call runs under AOTAutograd's own analysis mode, above ours: the
            # region runs without any (that analysis only feeds a warning about custom ops).
            mode = next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, ProbeDispatchMode)),
                        None)
            modes_off = _disable_current_modes
        if mode is None or not mode.tracer.recording:
            return original(graph, inputs)  # the probe's own kernels, a paused tracer
        region = regions.of(graph)
        with modes_off():
            return mode.tracer.run_region(region, region.info, inputs)

    target.__call__ = call_recorded
    try:
        yield
    finally:
        target.__call__ = original
