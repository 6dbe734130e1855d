"""Eager vs compiled, judged per compiled region on its recorded inputs (issue 24 item 3).

A run recorded with ``compiled="keep"`` and ``compiled_inputs=True`` (or the dump mode) holds, for
each call of a compiled region, the graph Inductor compiled (``probe.rundir.region_graphs``), the
call's inputs and the compiled code's outputs. Here the graph is re-run node by node eagerly and
in fp64 on those inputs, and each output the compiled code returned (the function's results and
the activations it saves for backward: many of the graph's intermediate values) is judged:

- *consistent*: compiled and eager differ by no more than rounding, i.e. ``CONDITION`` times the
  larger of the op's rounding bound (``probe.analysis.precision.rounding``) and the smaller of the
  two sides' own errors against fp64 (what this computation's rounding can be seen to reach);
- *compiled* (a divergence): they differ by more, and the compiled value is further from fp64;
- *eager*: they differ by more, and the compiled value is the closer to fp64 (Inductor often is:
  it fuses, and keeps intermediates in registers at full precision).

A region's divergence is named at its earliest graph node (in graph order) judged *compiled*, and
at the module that node came from.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from probe.analysis.precision import CONDITION, own_error, rounding
from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.confined_files import read_in_run
from probe.rundir.region_graphs import compiled_dir, graph_from_json
from probe.rundir.run import Run
from probe.rundir.untrusted_reads import read_json
from probe.vocabulary.rounding import reduction_length

TENSOR_FILE_LIMIT = 1 << 30
MAX_JUDGED_CALLS = 64
"""Region calls judged per run at most (in step order): enough to see a region over several steps."""


@dataclass
class Region:
    """One recorded call of a compiled region: its graph and tensors."""

    op_id: str
    step: int
    rank: int
    graph: str
    gm: torch.fx.GraphModule
    modules: dict[str, str]
    """Graph node name -> the FQN of the module it came from."""
    inputs: list[Any]
    outputs: dict[int, torch.Tensor]
    """The compiled code's tensor outputs, by position in the graph's output list."""


def manifest_mapping(run: Run, step: int, rank: int, key: str) -> dict[str, Any]:
    """The step manifest's mapping under ``key``; empty when the step is unreadable or the
    entry is missing or not a mapping (a run directory is untrusted input)."""
    try:
        entry = run.step_info(step, rank).manifest.get(key) or {}
    except ProbeError:
        return {}
    return entry if isinstance(entry, dict) else {}


def region_entries(run: Run, step: int, rank: int) -> dict[str, dict[str, Any]]:
    """A step's region calls whose graphs were written: op id -> ``{"graph", "tensors"}``."""
    entries = manifest_mapping(run, step, rank, layout.COMPILED_FILES_KEY)
    return {op_id: e for op_id, e in entries.items()
            if isinstance(e, dict) and isinstance(e.get("graph"), str)}


def load_graph(run: Run, rank: int, name: str) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """A written region graph, rebuilt (a ProbeError naming the file when it cannot be)."""
    if not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise ProbeError(f"{name!r} is not a region graph name")
    path = compiled_dir(layout.rank_dir(run.path, rank)) / f"{name}.json"
    if not path.exists():
        raise ProbeError(f"{str(path)!r}: the region graph is missing")
    return graph_from_json(read_json(path, run=run.path), str(path))


def load_region(run: Run, step: int, rank: int, op_id: str) -> Region:
    """The recorded call ``op_id`` of step ``step``: a ProbeError naming what is missing."""
    entry = region_entries(run, step, rank).get(op_id)
    if entry is None:
        raise ProbeError(f"step {step} rank {rank} of {str(run.path)!r} has no written compiled region "
                         f"{op_id!r} (record with compiled='keep')")
    tensors_rel = entry.get("tensors")
    if not isinstance(tensors_rel, str):
        raise ProbeError(f"compiled region {op_id!r} (step {step}) has no recorded inputs: record with "
                         "compiled='keep', compiled_inputs=True (or the dump mode)")
    gm, modules = load_graph(run, rank, entry["graph"])
    path = layout.rank_dir(run.path, rank) / tensors_rel
    from safetensors import safe_open
    from safetensors.torch import load

    data = read_in_run(path, run.path, TENSOR_FILE_LIMIT)
    try:
        tensors = load(data)
        with safe_open(str(path), "pt") as f:  # header only: the count and the scalars
            meta = f.metadata() or {}
        count = int(meta.get("inputs", "0"))
        scalars = json.loads(meta.get("scalars", "{}"))
    except Exception as e:  # a damaged file: named, not a traceback
        raise ProbeError(f"{str(path)!r}: not a region tensor file ({type(e).__name__}: {e})") from None
    inputs = [tensors.get(f"in.{i}", scalars.get(str(i))) for i in range(count)]
    outputs = {int(k[4:]): t for k, t in tensors.items() if k.startswith("out.") and k[4:].isdigit()}
    return Region(op_id, step, rank, entry["graph"], gm, modules, inputs, outputs)


class _Values(torch.fx.Interpreter):
    """Runs a graph node by node, keeping every node's value; ``fp64`` computes in float64
    (floating tensors and dtype arguments raised), the exact reference."""

    def __init__(self, gm: torch.fx.GraphModule, fp64: bool) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self._fp64 = fp64

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        if self._fp64:
            args, kwargs = _raised(args), _raised(kwargs)
        return super().call_function(target, args, kwargs)


def _raised(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, torch.dtype):
        return torch.float64 if value.is_floating_point else value
    if isinstance(value, (list, tuple)):
        return type(value)(_raised(v) for v in value)
    if isinstance(value, dict):
        return {k: _raised(v) for k, v in value.items()}
    return value


def node_values(gm: torch.fx.GraphModule, inputs: list[Any], fp64: bool = False) -> dict[str, Any]:
    """Every node's value when ``gm`` runs eagerly on ``inputs`` (no grad, the RNG left as it was)."""
    interpreter = _Values(gm, fp64)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        interpreter.run(*(_raised(list(inputs)) if fp64 else list(inputs)))
    return {node.name: value for node, value in interpreter.env.items()}


def draws_random(gm: torch.fx.GraphModule) -> bool:
    """Whether an op of the graph draws random numbers (compiled code draws its own)."""
    return any(isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags
               for n in gm.graph.nodes if n.op == "call_function")


@dataclass
class Judgement:
    """One value compiled code computed, against eager and fp64."""

    node: str
    module: str | None
    kind: str
    """``consistent``, ``compiled`` (compiled further from fp64 beyond rounding) or ``eager``."""
    difference: float
    allowed: float
    compiled_error: float
    eager_error: float


def judge_value(compiled: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor | None,
                reduction: int = 1) -> tuple[str, float, float, float, float] | None:
    """(kind, difference, allowed, compiled's error, eager's error) of one floating value, None for
    another kind of value (see the module docstring for the rule)."""
    if not (isinstance(compiled, torch.Tensor) and isinstance(eager, torch.Tensor)
            and eager.is_floating_point() and compiled.shape == eager.shape):
        return None
    c, e = compiled.detach().to("cpu"), eager.detach().to("cpu")
    x = exact.detach().to("cpu") if isinstance(exact, torch.Tensor) and exact.shape == eager.shape else e
    bound = rounding(e.dtype, reduction)
    err_c, err_e = own_error(c, x), own_error(e, x)
    difference = own_error(c, e)
    if bool((torch.isfinite(e) & ~torch.isfinite(c)).any()):
        difference = err_c = math.inf  # compiled lost values eager kept
    allowed = CONDITION * max(min(err_c, err_e), bound)
    kind = "consistent" if difference <= allowed else "compiled" if err_c > err_e else "eager"
    return kind, difference, allowed, err_c, err_e


def _reduction(node: torch.fx.Node, values: dict[str, Any]) -> int:
    if not isinstance(node.target, torch._ops.OpOverload):
        return 1
    args = [values.get(a.name) if isinstance(a, torch.fx.Node) else a for a in node.args]
    return reduction_length(str(node.target), args)


def output_nodes(gm: torch.fx.GraphModule) -> list[Any]:
    """The graph's output list: a node, or a constant, per position."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    result = out.args[0]
    return list(result) if isinstance(result, (list, tuple)) else [result]


@dataclass
class RegionVerdict:
    """A region call judged: each compiled output against eager and fp64."""

    op_id: str
    step: int
    rank: int
    graph: str
    judgements: list[Judgement] = field(default_factory=list)
    skipped: str | None = None
    """Why the region was not judged (it draws random numbers; its graph failed to re-run)."""

    @property
    def divergence(self) -> Judgement | None:
        """The earliest (graph order) value compiled code computed further from fp64 beyond rounding."""
        return next((j for j in self.judgements if j.kind == "compiled"), None)

    @property
    def eager_worse(self) -> Judgement | None:
        return next((j for j in self.judgements if j.kind == "eager"), None)

    def sentence(self, label: str) -> str:
        d = self.divergence
        if d is not None:
            where = f"node {d.node}" + (f" in {d.module}" if d.module else "")
            return (f"{label}'s compiled region {self.op_id} (step {self.step}) differs from its graph run "
                    f"eagerly beyond rounding at {where}: compiled is further from fp64 "
                    f"({d.compiled_error:.3g} vs eager's {d.eager_error:.3g}, allowed {d.allowed:.3g}); "
                    f"probe repro {{run}} '{self.op_id}' --step {self.step} writes a repro")
        e = self.eager_worse
        if e is not None:
            where = f"node {e.node}" + (f" in {e.module}" if e.module else "")
            return (f"{label}'s compiled region {self.op_id} (step {self.step}) differs from eager beyond "
                    f"rounding at {where}, but compiled is the closer to fp64 ({e.compiled_error:.3g} vs "
                    f"eager's {e.eager_error:.3g})")
        return (f"{label}'s compiled region {self.op_id} (step {self.step}): consistent with compiled "
                "code's rounding")


def judge_region(region: Region) -> RegionVerdict:
    """``region`` re-run eagerly and in fp64 on its recorded inputs, each compiled output judged."""
    verdict = RegionVerdict(region.op_id, region.step, region.rank, region.graph)
    gm = region.gm
    if draws_random(gm):
        verdict.skipped = "it draws random numbers (compiled code draws its own)"
        return verdict
    try:
        eager = node_values(gm, region.inputs)
    except Exception as e:  # the graph as written does not re-run here: said, not raised
        verdict.skipped = f"its graph did not re-run eagerly ({type(e).__name__}: {e})"
        return verdict
    try:
        exact: dict[str, Any] = node_values(gm, region.inputs, fp64=True)
    except Exception:  # an op without a float64 kernel: judged against eager's own rounding only
        exact = {}
    order = {node.name: i for i, node in enumerate(gm.graph.nodes)}
    judged: list[Judgement] = []
    nodes = {n.name: n for n in gm.graph.nodes}
    for position, node in enumerate(output_nodes(gm)):
        compiled = region.outputs.get(position)
        if not isinstance(node, torch.fx.Node) or compiled is None or node.op == "placeholder":
            continue
        found = judge_value(compiled, eager.get(node.name), exact.get(node.name),
                            _reduction(nodes[node.name], eager))
        if found is not None:
            judged.append(Judgement(node.name, region.modules.get(node.name), *found))
    # One judgement per node (a node may be returned twice), in graph order.
    unique = {j.node: j for j in judged}
    verdict.judgements = sorted(unique.values(), key=lambda j: order[j.node])
    return verdict


def run_verdicts(run: Run, limit: int = MAX_JUDGED_CALLS) -> list[RegionVerdict]:
    """Every recorded region call of ``run`` with its tensors (at most ``limit``), judged."""
    verdicts: list[RegionVerdict] = []
    for rank in run.ranks:
        for step in run.steps_of(rank):
            for op_id, entry in region_entries(run, step, rank).items():
                if not isinstance(entry.get("tensors"), str) or len(verdicts) >= limit:
                    continue
                try:
                    region = load_region(run, step, rank, op_id)
                except ProbeError as e:
                    verdicts.append(RegionVerdict(op_id, step, rank, str(entry.get("graph")), skipped=str(e)))
                    continue
                verdicts.append(judge_region(region))
    return verdicts


def verdict_note(run: Run, label: str) -> str | None:
    """The sentence a comparison's conclusion carries about ``run``'s compiled regions judged on
    their recorded inputs; None when the run recorded none."""
    verdicts = [v for v in run_verdicts(run) if v.skipped is None]
    if not verdicts:
        return None
    for pick in (lambda v: v.divergence is not None, lambda v: v.eager_worse is not None):
        found = next((v for v in verdicts if pick(v)), None)
        if found is not None:
            return found.sentence(label).replace("{run}", str(run.path))
    return (f"{label}'s compiled regions ({len(verdicts)} calls judged against eager and fp64 on their "
            "recorded inputs): consistent with compiled code's rounding")


def region_calls(run: Run, op_id: str, step: int | None = None) -> list[tuple[int, int]]:
    """(step, rank) of each recorded call ``op_id`` with its tensors, in step order."""
    found = []
    for rank in run.ranks:
        for s in run.steps_of(rank):
            if step is not None and s != step:
                continue
            entry = region_entries(run, s, rank).get(op_id)
            if entry is not None and isinstance(entry.get("tensors"), str):
                found.append((s, rank))
    return sorted(found)


def graph_file(run: Run, rank: int, name: str) -> Path:
    """The readable code of a written region graph."""
    return compiled_dir(layout.rank_dir(run.path, rank)) / f"{name}.py"
