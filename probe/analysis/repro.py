"""``probe repro``: a compiled region reduced to the smallest subgraph that still differs (issue 24
item 4), written as a standalone script.

The region's graph and recorded inputs (``probe.analysis.compiled_judge``) are re-run eagerly to
get every node's value. A subgraph of a node set takes, for each value it reads from outside the
set, a new input holding that eager value, and returns the set's values nothing in it reads.
It *shows the difference* when Inductor's code for it computes an output that
:func:`~probe.analysis.compiled_judge.judge_value` judges ``compiled`` (further from fp64 than
eager, beyond rounding).

Search, counting Inductor compiles (each costs seconds): (1) the whole graph compiled once with
every node's value returned: the earliest node judged ``compiled`` whose inputs are not is the
suspect; (2) the suspect alone; (3) where that no longer shows it (the difference needs a fusion
of several nodes), delta debugging (ddmin) over the suspect and its ancestors, within a budget of
compiles. The script loads its inputs (and fp64 references) from a safetensors file beside it,
asserts compiled against eager and fp64 by the same rule, and passes with ``--eager``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from probe.analysis.compiled_judge import Region, judge_value, node_values
from probe.analysis.precision import CONDITION, rounding
from probe.errors import ProbeError

MAX_COMPILES = 24


@dataclass
class Subgraph:
    gm: torch.fx.GraphModule
    inputs: list[Any]
    outputs: list[str]
    """The original node each output is."""


def subgraph(gm: torch.fx.GraphModule, keep: set[str], values: dict[str, Any],
             outputs: list[str] | None = None) -> Subgraph:
    """The nodes ``keep`` of ``gm`` as a graph of their own (see the module docstring)."""
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    inputs: list[Any] = []
    kept = [n for n in gm.graph.nodes if n.name in keep and n.op == "call_function"]

    def outside(node: torch.fx.Node) -> torch.fx.Node:
        if node.name not in env:
            env[node.name] = graph.placeholder(f"in_{node.name}")
            inputs.append(values[node.name])
        return env[node.name]

    for node in kept:
        for arg in node.all_input_nodes:
            if arg.name not in keep or arg.op != "call_function":
                outside(arg)
        env[node.name] = graph.node_copy(node, lambda n: env[n.name])
    if outputs is None:
        names = {n.name for n in kept}
        outputs = [n.name for n in kept if not any(u.name in names for u in n.users)
                   and isinstance(values.get(n.name), torch.Tensor)]
    graph.output(tuple(env[name] for name in outputs))
    return Subgraph(torch.fx.GraphModule(torch.nn.Module(), graph), inputs, outputs)


def compiled_outputs(sub: Subgraph) -> list[Any]:
    """``sub`` compiled by Inductor (fresh: no FX graph cache) and run on its inputs."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), torch.no_grad():
        return list(torch.compile(sub.gm, backend="inductor", fullgraph=True)(*sub.inputs))


def _judged(sub: Subgraph, compiled: list[Any], eager: dict[str, Any],
            exact: dict[str, Any]) -> dict[str, str]:
    kinds = {}
    for name, value in zip(sub.outputs, compiled, strict=True):
        found = judge_value(value, eager.get(name), exact.get(name))
        if found is not None:
            kinds[name] = found[0]
    return kinds


def ddmin(items: list[str], shows: Callable[[list[str]], bool]) -> list[str]:
    """Zeller's delta debugging: a 1-minimal sublist of ``items`` for which ``shows`` holds
    (``shows(items)`` is taken to hold)."""
    n = 2
    while len(items) >= 2:
        chunk = math.ceil(len(items) / n)
        subsets = [items[i:i + chunk] for i in range(0, len(items), chunk)]
        reduced = False
        for subset in subsets:
            if shows(subset):
                items, n, reduced = subset, 2, True
                break
        if not reduced:
            for subset in subsets:
                complement = [i for i in items if i not in subset]
                if complement and shows(complement):
                    items, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


@dataclass
class Reduction:
    """What :func:`reduce_region` found."""

    nodes: list[str]
    sub: Subgraph
    compiles: int
    exact: list[Any]


def reduce_region(region: Region, max_compiles: int = MAX_COMPILES) -> Reduction:
    """The smallest node set of ``region``'s graph whose compiled code still differs from eager
    beyond rounding (a ProbeError when the whole graph does not)."""
    gm = region.gm
    eager = node_values(gm, region.inputs)
    exact = node_values(gm, region.inputs, fp64=True)
    computed = [n for n in gm.graph.nodes if n.op == "call_function"]
    names = {n.name for n in computed}
    outputs = [n.name for n in computed if isinstance(eager.get(n.name), torch.Tensor)]
    compiles = 0

    def shows(keep: list[str]) -> bool:
        nonlocal compiles
        if compiles >= max_compiles:
            return False
        sub = subgraph(gm, set(keep), eager)
        if not sub.outputs:
            return False
        compiles += 1
        try:
            return "compiled" in _judged(sub, compiled_outputs(sub), eager, exact).values()
        except Exception:  # a subgraph Inductor cannot compile does not show the difference
            return False

    everything = subgraph(gm, names, eager, outputs)
    compiles += 1
    kinds = _judged(everything, compiled_outputs(everything), eager, exact)
    order = [n.name for n in computed]
    suspect = next((n for n in computed if kinds.get(n.name) == "compiled"
                    and not any(kinds.get(a.name) == "compiled" for a in n.all_input_nodes)), None)
    if suspect is None:
        raise ProbeError(f"compiled region {region.op_id} (step {region.step}): Inductor's code for its "
                         "graph computes no value further from fp64 than eager beyond rounding here: nothing "
                         "to reduce")
    if shows([suspect.name]):
        keep = [suspect.name]
    else:
        ancestors: set[str] = set()
        stack = [suspect]
        while stack:
            node = stack.pop()
            if node.name in ancestors or node.name not in names:
                continue
            ancestors.add(node.name)
            stack += node.all_input_nodes
        keep = ddmin([n for n in order if n in ancestors], shows)
    sub = subgraph(gm, set(keep), eager)
    return Reduction(keep, sub, compiles, [exact.get(name) for name in sub.outputs])


_SCRIPT = '''"""Repro written by `probe repro`: compiled region {op_id} (step {step}) of {run},
reduced to {count} graph node(s) ({nodes}) whose Inductor code computes a value further from fp64
than eager beyond rounding. Inputs and fp64 references: {tensor_file} (beside this script).

    python {script_name}           # compiled with Inductor: fails (AssertionError) while the bug is there
    python {script_name} --eager   # the same graph run eagerly: passes
"""

import math
import sys
from pathlib import Path

import torch
import torch._inductor.config
import torch.fx._pytree
import torch.utils._pytree
from safetensors.torch import load_file
from torch import device  # noqa: F401  (the graph's code may name devices)

inf, nan = math.inf, math.nan
NoneType = type(None)
fx_pytree = torch.fx._pytree
pytree = torch.utils._pytree
CONDITION = {condition!r}
BOUNDS = {bounds!r}  # per output: the rounding bound of its dtype
OUTPUTS = {outputs!r}  # the graph node each output is

{code}

def error(a, b):
    """max |a - b| / max(|b|, rms(b)) over finite elements."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(finite.any()):
        return 0.0
    a, b = a[finite], b[finite]
    rms = float(b.square().mean().sqrt())
    scale = torch.clamp(b.abs(), min=rms) if rms > 0 else torch.ones_like(b)
    return float(((a - b).abs() / scale).max())


def main():
    tensors = load_file(str(Path(__file__).with_name({tensor_file!r})))
    inputs = [tensors[f"in.{{i}}"] for i in range({n_inputs})]
    exact = [tensors[f"exact.{{i}}"] for i in range(len(OUTPUTS))]
    torch._inductor.config.fx_graph_cache = False

    def graph(*args):
        return forward(None, *args)

    with torch.no_grad():
        eager = graph(*inputs)
        run = graph if "--eager" in sys.argv else torch.compile(graph, backend="inductor", fullgraph=True)
        result = run(*inputs)
    for k, name in enumerate(OUTPUTS):
        err_r, err_e = error(result[k], exact[k]), error(eager[k], exact[k])
        diff = error(result[k], eager[k])
        if bool((torch.isfinite(eager[k]) & ~torch.isfinite(result[k])).any()):
            diff = err_r = math.inf
        allowed = CONDITION * max(min(err_r, err_e), BOUNDS[k])
        assert not (diff > allowed and err_r > err_e), (
            f"{{name}}: compiled differs from eager by {{diff:.3g}} (allowed {{allowed:.3g}}); "
            f"error against fp64: compiled {{err_r:.3g}}, eager {{err_e:.3g}}")
    print("ok: compiled agrees with eager within rounding")


if __name__ == "__main__":
    main()
'''


def write_script(region: Region, reduction: Reduction, out: Path, run_path: str) -> Path:
    """The repro script at ``out`` and its tensors beside it (``<stem>.safetensors``)."""
    from safetensors.torch import save_file

    sub = reduction.sub
    code = sub.gm.graph.python_code(root_module="self")
    unknown = set(code.globals) - {"torch", "device", "inf", "nan", "builtins", "operator", "NoneType",
                                   "fx_pytree", "pytree"}
    if unknown:
        raise ProbeError(f"the reduced graph's code names {sorted(unknown)}, which a standalone script "
                         "cannot define")
    src = code.src.strip("\n")
    if "import operator" not in src and "operator." in src:
        src = "import operator\n" + src
    tensors: dict[str, torch.Tensor] = {}
    for i, value in enumerate(sub.inputs):
        if not isinstance(value, torch.Tensor):
            raise ProbeError(f"input {i} of the reduced graph is not a tensor ({value!r})")
        tensors[f"in.{i}"] = value.detach().contiguous().clone()
    for i, value in enumerate(reduction.exact):
        tensors[f"exact.{i}"] = value.detach().contiguous().clone()
    out_node = next(n for n in sub.gm.graph.nodes if n.op == "output")
    bounds = [rounding(r.dtype) for r in node_values(sub.gm, sub.inputs)[out_node.name]]
    out = Path(out)
    tensor_file = out.with_suffix(".safetensors").name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out.with_suffix(".safetensors")))
        out.write_text(_SCRIPT.format(
            op_id=region.op_id, step=region.step, run=run_path, count=len(reduction.nodes),
            nodes=", ".join(reduction.nodes), tensor_file=tensor_file, script_name=out.name,
            condition=CONDITION, bounds=bounds, outputs=sub.outputs, code=src, n_inputs=len(sub.inputs)))
    except OSError as e:
        raise ProbeError(f"cannot write the repro {str(out)!r}: {e.strerror or e}") from None
    return out

