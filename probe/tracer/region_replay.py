"""Inside a compiled region: its graph re-run node by node, each op recorded in its module.

Inductor's fused kernels never reach a dispatch mode, so what a compiled region computes inside
is not seen as it runs. Under ``compiled="keep"`` the probe keeps the FX graph Inductor compiled
(``probe.tracer.compiled_regions`` copies it, node metadata included, before Inductor's passes
rewrite it) and, right after each call of the compiled region, re-runs that graph eagerly, node
by node (a ``torch.fx.Interpreter``), on the same inputs. Each aten op of the graph is recorded
as an op of the module its node came from (the node's ``nn_module_stack``), in the frame of
that module's call: ``model.layers.1.post_attention_layernorm[0]``, as the eager twin's ops are.
A backward graph's nodes carry the stack of the forward node they differentiate; their ops are
recorded in the forward's frames, phase ``backward``.

What this sees: everything the graph says, which includes code that runs only when compiling
(``torch.compiler.is_compiling()``), dynamo's and AOTAutograd's rewrites and Inductor's
decompositions, as eager kernels compute them; what the compiled kernels make of it is the
region op's outputs (the compiled numerics). The re-run costs about one eager run of the region,
holds no autograd graph, leaves the RNG as it was (a random op draws from a forked generator)
and writes no input (an input the graph mutates is re-run on a copy).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from probe.tracer.frames import Frame
from probe.tracer.module_tracker import ModuleTracker

_ROOT = re.compile(r"^(?:[LG]\[[^\]]*\](?:\[[^\]]*\])*)\.?")
"""The root object of an ``nn_module_stack`` path: ``L['self']``, ``L['args'][0]``, ``G['m']``."""
_INDEX = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def module_path(stack_path: str) -> str:
    """The module's path below the object dynamo compiled ("" for that object itself):
    ``L['args'][0].model.layers[1].mlp`` -> ``model.layers.1.mlp``."""
    rest = _ROOT.sub("", stack_path, count=1)
    rest = _INDEX.sub(lambda m: "." + (m.group(1) if m.group(1) is not None else m.group(2)), rest)
    rest = rest.replace("._modules.", ".").removeprefix("_modules.")
    return rest.strip(".")


class ModuleResolver:
    """Paths below a compiled object -> the FQNs the run names modules by.

    The object dynamo compiled may be the ``model=`` root itself, a submodule of it, or wrap it
    (an ``OptimizedModule``'s ``_orig_mod``): a path is taken as the known FQN that equals it or
    ends with it, the shortest such (the region's own frame when none does)."""

    def __init__(self, known: dict[str, str]) -> None:
        self._known = known
        self._cache: dict[tuple[str, str], str | None] = {}

    def fqn(self, path: str, region_fqn: str) -> str | None:
        key = (path, region_fqn)
        if key not in self._cache:
            self._cache[key] = self._resolve(path, region_fqn)
        return self._cache[key]

    def _resolve(self, path: str, region_fqn: str) -> str | None:
        if not path:
            return None
        inside = f"{region_fqn}.{path}" if region_fqn else path
        if inside in self._known:
            return inside
        ends = [fqn for fqn in self._known if fqn == path or fqn.endswith("." + path)]
        return min(ends, key=len) if ends else None


class RegionReplay:
    """Re-runs kept region graphs node by node through ``dispatch`` (the tracer's per-op entry,
    called with the dispatch mode off), each node in the frame of its module."""

    def __init__(self, modules: ModuleTracker, dispatch: Callable[[Any, tuple, dict], Any]) -> None:
        self._modules = modules
        self._dispatch = dispatch
        self._resolver = ModuleResolver(modules.names.types)
        self._forward_frames: dict[Any, dict[str, Frame]] = {}
        """Per AOT graph id: the frames the latest forward re-run opened, by nn_module_stack key,
        for its backward graph's nodes."""

    def run(self, gm: torch.fx.GraphModule, inputs: list[Any], region_frame: Frame, graph_id: Any,
            backward: bool, base: str | None = None) -> None:
        """``base``: the FQN of the object the graph's ``nn_module_stack`` paths start from (the
        compiled frame's ``self``; by default the region's frame)."""
        frames: dict[str, Frame]
        if backward:
            frames = self._forward_frames.get(graph_id, {})
        else:
            frames = self._forward_frames[graph_id] = {}
        inputs = _unaliased(gm, inputs)
        interpreter = _AttributingInterpreter(gm, self, frames, region_frame, opens=not backward,
                                              base=region_frame.fqn if base is None else base)
        devices = sorted({t.device.index for t in inputs if isinstance(t, torch.Tensor)
                          and t.device.type == "cuda" and t.device.index is not None})
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            interpreter.run(*inputs)

    def node_modules(self, gm: torch.fx.GraphModule, region_fqn: str) -> dict[str, str | None]:
        """Node name -> the FQN of the innermost module its ``nn_module_stack`` names (None: none
        the run knows), as written beside the graph."""
        modules: dict[str, str | None] = {}
        for node in gm.graph.nodes:
            fqn = None
            for value in (node.meta.get("nn_module_stack") or {}).values():
                path = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else ""
                fqn = self._resolver.fqn(module_path(path), region_fqn) or fqn
            modules[node.name] = fqn
        return modules

    def frame_of(self, node: torch.fx.Node, frames: dict[str, Frame], region_frame: Frame,
                 opens: bool, base: str) -> Frame:
        stack = node.meta.get("nn_module_stack") or {}
        frame = region_frame
        for key, value in stack.items():
            known = frames.get(key)
            if known is not None:
                frame = known
                continue
            if not opens:
                continue  # a backward node of a module its forward did not show: the nearest known
            path = value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else ""
            fqn = self._resolver.fqn(module_path(path), base)
            if fqn is None or fqn == frame.fqn:
                continue
            frame = frames[key] = self._modules.open_frame(fqn, frame)
        return frame


class _AttributingInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, replay: RegionReplay, frames: dict[str, Frame],
                 region_frame: Frame, opens: bool, base: str) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self._replay, self._frames, self._region_frame, self._opens = replay, frames, region_frame, opens
        self._base = base

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if not isinstance(target, torch._ops.OpOverload):
            return super().call_function(target, args, kwargs)
        frame = self._replay.frame_of(self.current_node, self._frames, self._region_frame, self._opens,
                                      self._base)
        with self._replay._modules.speaking_for(frame):
            if target is not torch.ops.aten.view.default or _viewable(args):
                return self._replay._dispatch(target, args, kwargs)
            # The graph's view was traced on the layout the compiled kernels give a value; the
            # eager kernels of the re-run may give it other strides (falcon_mamba's scan), where
            # the view raises. A contiguous copy holds the same values, so the view applies.
            copy = self._replay._dispatch(torch.ops.aten.clone.default, (args[0],),
                                          {"memory_format": torch.contiguous_format})
            return self._replay._dispatch(target, (copy, *args[1:]), kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current_node = n
        return super().run_node(n)


def _viewable(args: tuple) -> bool:
    """Whether ``aten.view(*args)`` applies to its tensor's strides (without computing it)."""
    tensor = args[0] if args else None
    if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous() or len(args) < 2:
        return True
    try:
        torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta").view(args[1])
    except RuntimeError:
        return False
    return True


def _unaliased(gm: torch.fx.GraphModule, inputs: list[Any]) -> list[Any]:
    """``inputs``, with a copy of each one an op of the graph writes (a buffer update)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written: set[int] = set()
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for i, argument in enumerate(target._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, torch.fx.Node) and value.op == "placeholder":
                written.add(placeholders.index(value))
    if not written:
        return list(inputs)
    return [t.clone() if i in written and isinstance(t, torch.Tensor) else t for i, t in enumerate(inputs)]
