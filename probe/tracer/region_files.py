"""Writes what ``compiled="keep"`` kept of each compiled region to the run directory.

Each kept graph once per rank (its JSON form and its code, ``probe.rundir.region_graphs``), and,
when asked (``compiled_inputs=True`` or the dump mode), each opened region call's tensor inputs
and compiled outputs, within a byte budget per run: enough to judge a region against its eager
and fp64 re-runs later (``probe.analysis.compiled_judge``) and to reduce it to a repro.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.fx

from probe.errors import warn_once
from probe.rundir import layout
from probe.rundir.region_graphs import (
    UnencodableGraph,
    compiled_dir,
    graph_to_json,
    region_tensor_name,
    scalar_metadata,
)

DEFAULT_TENSOR_BUDGET = 512 << 20
"""Bytes of region tensors one rank writes at most over the run; calls past it write none."""


class RegionFiles:
    """The compiled-region files of one rank's run."""

    def __init__(self, out: Path, rank: int, tensors: bool, budget: int = DEFAULT_TENSOR_BUDGET) -> None:
        self._dir = compiled_dir(layout.rank_dir(out, rank))
        self._tensors = tensors
        self._budget = budget
        self._graphs: dict[int, str | None] = {}
        self._steps: dict[int, dict[str, dict[str, Any]]] = {}
        self._keep: list[Any] = []  # the graphs named, so their ids stay theirs

    def graph_name(self, gm: torch.fx.GraphModule, region: str, backward: bool,
                   modules: dict[str, str | None]) -> str | None:
        """The name ``gm`` is written under (written on its first call), None when it cannot be."""
        key = id(gm)
        if key in self._graphs:
            return self._graphs[key]
        name = f"graph{len(self._graphs):03d}_{region.removeprefix('compiled.')}_" \
               f"{'backward' if backward else 'forward'}"
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:150]
        self._keep.append(gm)
        try:
            doc = graph_to_json(gm, modules)
            self._dir.mkdir(parents=True, exist_ok=True)
            (self._dir / f"{name}.json").write_text(json.dumps(doc))
            (self._dir / f"{name}.py").write_text(gm.print_readable(print_output=False))
        except (UnencodableGraph, OSError) as e:
            warn_once(f"region-graph-{name}", f"compiled region graph {name} not written ({e}); "
                      "its region cannot be judged from the run directory")
            self._graphs[key] = None
            return None
        self._graphs[key] = name
        return name

    def record(self, step: int, op_id: str, graph: str, inputs: list[Any], outputs: Any) -> None:
        """One opened region call: its entry in the step manifest and, when asked and within the
        budget, its tensors."""
        entries = self._steps.setdefault(step, {})
        entry: dict[str, Any] = {"graph": graph, "tensors": None}
        entries[op_id] = entry
        if not self._tensors:
            return
        outs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        named = {f"in.{i}": t for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        named.update({f"out.{i}": t for i, t in enumerate(outs) if isinstance(t, torch.Tensor)})
        size = sum(t.numel() * t.element_size() for t in named.values())
        if size > self._budget:
            warn_once("region-tensor-budget", f"compiled region tensors past the budget of this run "
                      f"({self._budget >> 20} MiB left, {op_id} needs {size >> 20} MiB): later region "
                      "calls write none")
            return
        from safetensors.torch import save_file

        # safetensors wants contiguous tensors that share no memory (a graph returns views).
        tensors = {k: t.detach().to("cpu").contiguous().clone() for k, t in named.items()}
        step_dir = self._dir / f"step{step}"
        file = region_tensor_name(len(entries) - 1)
        try:
            step_dir.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(step_dir / file), metadata={"op_id": op_id, "graph": graph,
                                                               "inputs": str(len(inputs)),
                                                               "outputs": str(len(outs)),
                                                               "scalars": scalar_metadata(inputs)})
        except OSError as e:
            warn_once("region-tensors-write", f"compiled region tensors not written ({e})")
            return
        self._budget -= size
        entry["tensors"] = f"compiled/step{step}/{file}"

    def take(self, step: int) -> dict[str, dict[str, Any]]:
        """The step's entries for its manifest (``layout.COMPILED_FILES_KEY``), forgotten here."""
        return self._steps.pop(step, {})
