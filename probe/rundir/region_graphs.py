"""A compiled region's graph and recorded tensors in the run directory (``compiled="keep"``).

Each FX graph Inductor compiled under the session is written once per rank, in
``rank<r>/compiled/``: ``<name>.json`` (its nodes: name, op, target, arguments, the module each
came from, all a reader needs to rebuild the graph and re-run it) and ``<name>.py`` (the graph's
code, for a person). With ``compiled_inputs=True`` or the dump mode, each call of an opened region
also writes ``rank<r>/compiled/step<N>/<call>.safetensors``: the graph's tensor inputs (``in.<i>``)
and the compiled graph's tensor outputs (``out.<i>``); its header metadata holds the inputs that
are not tensors (SymInts, as numbers). The step manifest's ``compiled_region_files`` entry maps a
region op id to its graph's name and its tensor file (null when it was not written).

The JSON form takes arguments that are nodes, numbers, strings, booleans, None, dtypes, devices,
layouts, memory formats and nested lists of them; a graph with anything else (a tensor constant)
is written as code only and cannot be re-run from the run directory.
"""

from __future__ import annotations

import json
import math
import operator
from pathlib import Path
from typing import Any

import torch
import torch.fx

from probe.errors import ProbeError

GRAPH_FORMAT = 1
NODE_OPS = ("placeholder", "call_function", "output")


class UnencodableGraph(Exception):
    """A graph whose nodes hold a value the JSON form cannot carry."""


def compiled_dir(rank_dir: Path) -> Path:
    return rank_dir / "compiled"


def region_tensor_name(number: int) -> str:
    """The tensor file of a step's ``number``-th written region call (op ids hold ':' and '/')."""
    return f"region{number:04d}.safetensors"


def _encode(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return {"list": [_encode(v) for v in value], "tuple": isinstance(value, tuple)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"torch": str(value).removeprefix("torch.")}
    raise UnencodableGraph(f"{type(value).__name__} {value!r}")


def _decode(value: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    if not isinstance(value, dict):
        return value
    if "node" in value:
        return nodes[value["node"]]
    if "float" in value:
        return float(value["float"])
    if "list" in value:
        items = [_decode(v, nodes) for v in value["list"]]
        return tuple(items) if value.get("tuple") else items
    if "dtype" in value:
        return _torch_attr(value["dtype"], torch.dtype)
    if "device" in value:
        return torch.device(value["device"])
    if "torch" in value:
        return _torch_attr(value["torch"], (torch.layout, torch.memory_format))
    raise ValueError(f"unknown argument form {value!r}")


def _torch_attr(name: str, kind: type | tuple[type, ...]) -> Any:
    found = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(found, kind):
        raise ValueError(f"torch.{name} is not a {kind}")
    return found


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    if target is operator.getitem:
        return "operator.getitem"
    raise UnencodableGraph(f"call target {target!r}")


def resolve_target(name: str) -> Any:
    """The callable a graph node's ``target`` names: ``aten.mm.default`` -> ``torch.ops.aten.mm.default``."""
    if name == "operator.getitem":
        return operator.getitem
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"not an op overload name: {name!r}")
    namespace, op, overload = parts
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as e:
        raise ValueError(f"this torch has no op {name!r}") from e
    if not isinstance(found, torch._ops.OpOverload):
        raise ValueError(f"{name!r} is not an op overload")
    return found


def graph_to_json(gm: torch.fx.GraphModule, modules: dict[str, str | None]) -> dict[str, Any]:
    """The JSON form of ``gm`` (see the module docstring); ``modules``: node name -> the FQN of the
    module it came from. Raises :class:`UnencodableGraph` for a graph it cannot carry."""
    nodes = []
    for node in gm.graph.nodes:
        if node.op not in NODE_OPS:
            raise UnencodableGraph(f"node {node.name} ({node.op})")
        entry: dict[str, Any] = {"name": node.name, "op": node.op}
        if node.op == "call_function":
            entry["target"] = _target_name(node.target)
        entry["args"] = _encode(list(node.args))
        entry["kwargs"] = {k: _encode(v) for k, v in node.kwargs.items()}
        module = modules.get(node.name)
        if module is not None:
            entry["module"] = module
        nodes.append(entry)
    return {"format": GRAPH_FORMAT, "nodes": nodes}


def graph_from_json(doc: Any, where: str) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """``doc`` (:func:`graph_to_json`'s form) rebuilt: the graph module and node name -> module FQN.
    A malformed document is a ProbeError naming ``where``."""
    try:
        graph = torch.fx.Graph()
        nodes: dict[str, torch.fx.Node] = {}
        modules: dict[str, str] = {}
        for entry in doc["nodes"]:
            name, op = entry["name"], entry["op"]
            args = tuple(_decode(entry["args"], nodes))
            kwargs = {k: _decode(v, nodes) for k, v in entry["kwargs"].items()}
            if op == "placeholder":
                node = graph.placeholder(name)
            elif op == "call_function":
                node = graph.call_function(resolve_target(entry["target"]), args, kwargs)
            elif op == "output":
                node = graph.output(args[0])
            else:
                raise ValueError(f"node op {op!r}")
            node.name = name
            nodes[name] = node
            if isinstance(entry.get("module"), str):
                modules[name] = entry["module"]
        graph.lint()
        return torch.fx.GraphModule(torch.nn.Module(), graph), modules
    except ProbeError:
        raise
    except Exception as e:  # any malformed part: the file is not a graph this reader can rebuild
        raise ProbeError(f"{where}: not a region graph this probe can rebuild "
                         f"({type(e).__name__}: {e})") from None


def scalar_metadata(inputs: list[Any]) -> str:
    """The inputs that are not tensors (SymInts as ints), by position, as JSON text."""
    scalars = {}
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            value = value.node.hint if hasattr(value.node, "hint") else int(value)
        scalars[str(i)] = value if isinstance(value, (int, float, bool)) or value is None else repr(value)
    return json.dumps(scalars)
