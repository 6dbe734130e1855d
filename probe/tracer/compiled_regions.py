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
from probe.rundir.op_record_fields import RECORD_FIELD_INDEX
from probe.tracer.region_replay import RegionReplay
from probe.vocabulary.op_class import OpClass

RECORD_ID = RECORD_FIELD_INDEX["op_id"]
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


def _compiled_self() -> Any:
    """The ``self`` of the dynamo-compiled frame that called the running graph (the module whose
    method dynamo compiled: the object its graph's ``nn_module_stack`` paths start from,
    ``L['self']``), or None (no such frame, or a function without ``self``)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_fn" and code.co_filename.endswith(_EVAL_FRAME_FILE):
            caller = frame.f_back
            return caller.f_locals.get("self") if caller is not None else None
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
        kept = getattr(graph, KEPT_GRAPH, None)
        tracer = mode.tracer
        # The compiled call empties its boxed input list: the re-run needs the inputs after it.
        held = list(inputs) if kept is not None else None
        with modes_off():
            recorded = len(tracer.records)
            out = tracer.run_region(region, region.info, inputs)
            if held is not None:
                replay = replays.get(id(tracer))
                if replay is None:
                    replay = replays[id(tracer)] = RegionReplay(tracer.modules, tracer.dispatch)
                fx_kwargs = getattr(graph, "fx_kwargs", None) or {}
                _, frame = tracer.modules.locate()
                # The paths of the graph's nn_module_stack start from the compiled frame's `self`.
                base = tracer.modules.names.known(_compiled_self())
                base = frame.fqn if base is None else base
                start = len(tracer.records)
                replay.run(kept, held, frame, fx_kwargs.get("graph_id"), bool(fx_kwargs.get("is_backward")),
                           base)
                if start > recorded:  # the region op itself was recorded (selected)
                    op_id = tracer.records[recorded][RECORD_ID]
                    tracer.opened_regions.append((op_id, start, len(tracer.records)))
                    files = tracer.region_files
                    if files is not None:
                        backward = bool(fx_kwargs.get("is_backward"))
                        name = files.graph_name(kept, region.info.name, backward,
                                                replay.node_modules(kept, base))
                        if name is not None:
                            files.record(tracer.step, op_id, name, held, out)
        return out

    replays: dict[int, RegionReplay] = {}
    target.__call__ = call_recorded
    undo_keep = _keep_compiled_graphs()
    try:
        yield
    finally:
        undo_keep()
        target.__call__ = original


KEPT_GRAPH = "_probe_fx_graph"
"""The attribute of a compiled graph (Inductor's ``CompiledFxGraph``) holding a copy of the FX
graph it was compiled from, while ``compiled="keep"`` is active (see :func:`_keep_compiled_graphs`)."""


def _keep_compiled_graphs() -> Callable[[], None]:
    """While the session runs with ``compiled="keep"``, each graph Inductor compiles keeps a copy of
    its FX graph, node metadata (``nn_module_stack``, ``stack_trace``) included, for
    :mod:`probe.tracer.region_replay`. Taken before Inductor's passes rewrite the graph in place.
    AOTAutograd's cache is off meanwhile: a cache hit would skip Inductor's compile, and with it
    the copy (Inductor's own FX graph cache is looked up after the copy is taken). Graphs compiled
    before the session keep nothing and are recorded as whole regions only. Returns the undo."""
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import compile_fx
    except Exception:  # pragma: no cover - no inductor
        return lambda: None
    original = getattr(compile_fx, "_compile_fx_inner", None)
    if original is None:  # pragma: no cover - another torch
        warn_once("compiled-graphs", "this torch has no torch._inductor.compile_fx._compile_fx_inner; "
                  "compiled regions are recorded whole, not node by node")
        return lambda: None

    def compile_keeping_graph(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        kept = _graph_copy(gm)
        out = original(gm, example_inputs, *args, **kwargs)
        if kept is not None and type(out).__name__ == "CompiledFxGraph":
            setattr(out, KEPT_GRAPH, kept)
        return out

    compile_fx._compile_fx_inner = compile_keeping_graph
    cache = getattr(functorch_config, "enable_autograd_cache", None)
    functorch_config.enable_autograd_cache = False

    def undo() -> None:
        compile_fx._compile_fx_inner = original
        if cache is not None:
            functorch_config.enable_autograd_cache = cache

    return undo


def _graph_copy(gm: Any) -> Any:
    """A GraphModule over a deep copy of ``gm``'s graph (nodes keep their metadata), or None."""
    import copy

    import torch.fx

    try:
        return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    except Exception as e:  # a graph that cannot be copied: the region is recorded whole
        warn_once("compiled-graph-copy", f"a compiled graph could not be kept ({type(e).__name__}: {e}); "
                  "its region is recorded whole, not node by node")
        return None
