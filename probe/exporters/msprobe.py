"""A run exported in msprobe's dump layout, so msprobe's own ``compare`` reads it.

For each (step, rank): ``OUT/step{N}/rank{R}/dump.json``, ``stack.json``,
``construct.json`` and, when the run holds dumped tensors, ``dump_tensor_data/``
with one ``.pt`` file per tensor (msprobe's ``tensor`` task; otherwise its
``statistics`` task). Format as read by mindstudio-probe 26.x; the details
that matter for its compare (verified against it):

- entries are named ``Aten.<op>.<overload>.<n>.<forward|backward>``: ``n``
  counts the calls of that overload in that direction within the step, as
  msprobe counts API calls (recompute and optimizer ops are forward calls);
  compare matches forward entries by exact name and backward ones by order;
- every tensor has ``type``, ``dtype`` (``torch.float32``), ``shape`` and
  ``Max``/``Min``/``Mean``/``Norm`` (from the run's statistics, or computed in
  fp64 from the dumped tensor); in the tensor task ``data_name`` is
  ``<entry>.<input|output>.<i>.pt``;
- ``construct.json`` maps each entry to its module call
  (``Module.<fqn>.<Class>.forward.<call>``); ``stack.json`` uses msprobe's
  ``{"<n>": [[entry names], [stack lines]]}`` form, when call sites were recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from probe.errors import ProbeError
from probe.rundir.run import OpRecord, Run, TensorRecord
from probe.rundir.tensor_layouts import dense_values

_STAT_KEYS = (("Max", "max"), ("Min", "min"), ("Mean", "mean"), ("Norm", "norm"))


def _number(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _stats_of(t: torch.Tensor) -> dict[str, float | None]:
    x = torch.view_as_real(t) if t.is_complex() else t
    x = x.detach().to(torch.float64)
    if x.numel() == 0:
        return {"Max": None, "Min": None, "Mean": None, "Norm": 0.0}
    return {"Max": x.max().item(), "Min": x.min().item(), "Mean": x.mean().item(),
            "Norm": torch.linalg.vector_norm(x).item()}


def _msprobe_stack_line(line: str) -> str:
    """``path:12 in func`` (ours) -> ``File path, line 12, in func, \\n `` (msprobe's)."""
    location, _, func = line.partition(" in ")
    path, _, lineno = location.rpartition(":")
    return f"File {path}, line {lineno}, in {func}, \n "


def _entry_names(ops: list[OpRecord]) -> list[str]:
    counters: dict[tuple[str, str], int] = defaultdict(int)
    names = []
    for op in ops:
        api = op.name.removeprefix("aten.")
        direction = "backward" if op.phase == "backward" else "forward"
        n = counters[(api, direction)]
        counters[(api, direction)] += 1
        names.append(f"Aten.{api}.{n}.{direction}")
    return names


_NAME_BYTES = 200
"""The longest tensor file name written (file systems allow 255 bytes)."""


def _file_name(name: str, suffix: str) -> str:
    """``name`` + ``suffix`` as one file name whatever the op is called (a run's op names are
    not trusted): the characters a path gives meaning to (``/``, ``\\``, NUL) and ``%`` are
    percent-encoded, so distinct entries keep distinct files; a leading dot too (no hidden
    files); a name too long for the file system is cut and told apart by a hash of the whole."""
    safe = "".join(f"%{ord(c):02X}" if c in "/\\\0%" else c for c in name)
    if safe.startswith("."):
        safe = "%2E" + safe[1:]
    if len(safe.encode()) + len(suffix) > _NAME_BYTES:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        safe = safe.encode()[: _NAME_BYTES - len(suffix) - 17].decode("utf-8", "ignore") + "-" + digest
    return safe + suffix


class _StepExport:
    def __init__(self, run: Run, step: int, rank: int, directory: Path) -> None:
        self.run, self.step, self.rank, self.directory = run, step, rank, directory
        self.ops = run.ops(step, rank)
        self.dump = run.dump(step, rank) if run.has_dump(step, rank) else None
        self.task = "tensor" if self.dump is not None else "statistics"
        has_stats = any(t.stats is not None for op in self.ops for t in op.outputs)
        if self.dump is None and not has_stats:
            raise ProbeError(
                f"step {step} rank {rank} of {str(run.path)!r} has neither statistics nor tensors: "
                "record it with the 'stats' or 'dump' mode to export it for msprobe"
            )

    def tensor_dict(self, op: OpRecord, io: str, position: int, record: TensorRecord,
                    entry: str) -> dict[str, Any] | None:
        out: dict[str, Any] = {
            "type": "torch.Tensor", "dtype": f"torch.{record.dtype}", "shape": list(record.shape),
        }
        tensor = None
        if self.dump is not None:
            dumped = self.dump.entries.get((op.index, io, position))
            if dumped is None or dumped.status is not None:
                return None  # a tensor without data cannot be compared in msprobe's tensor task
            # msprobe reads plain tensors: a sparse, nested or quantized one as the values it holds
            tensor = dense_values(self.dump.tensor(op.index, io, position))
        if record.stats is not None:
            out.update({key: _number(record.stats[ours]) for key, ours in _STAT_KEYS})
        elif tensor is not None:
            out.update(_stats_of(tensor))
        if tensor is not None:
            data_name = _file_name(f"{entry}.{io}.{position}", ".pt")
            torch.save(tensor.detach().contiguous().clone(), self.directory / "dump_tensor_data" / data_name)
            out["data_name"] = data_name
        return out

    def write(self, progress: Progress, task_id: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.task == "tensor":
            (self.directory / "dump_tensor_data").mkdir(exist_ok=True)
        names = _entry_names(self.ops)
        types = self.run.module_types(self.step, self.rank)
        data: dict[str, Any] = {}
        construct: dict[str, str | None] = {}
        stacks: dict[tuple[str, ...], list[str]] = {}
        for op, entry in zip(self.ops, names, strict=True):
            inputs = [self.tensor_dict(op, "input", i, t, entry) for i, t in enumerate(op.inputs)]
            outputs = [self.tensor_dict(op, "output", i, t, entry) for i, t in enumerate(op.outputs)]
            if entry.endswith(".forward"):
                data[entry] = {"input_args": inputs, "input_kwargs": {}, "output": outputs}
            else:
                data[entry] = {"input": inputs, "output": outputs}
            construct[entry] = (
                f"Module.{op.module}.{types.get(op.module, 'Module')}.forward.{op.module_call}"
                if op.module and op.module_call >= 0 else None
            )
            if op.stack:
                stacks.setdefault(tuple(op.stack), []).append(entry)
            progress.advance(task_id)
        tensor_dir = self.directory / "dump_tensor_data"
        dump_json = {"task": self.task, "level": "L1", "framework": "pytorch",
                     "dump_data_dir": str(tensor_dir) if self.task == "tensor" else None, "data": data}
        (self.directory / "dump.json").write_text(json.dumps(dump_json, indent=1))
        (self.directory / "construct.json").write_text(json.dumps(construct, indent=1))
        stack_json = {
            str(i): [entries, [_msprobe_stack_line(line) for line in reversed(lines)]]
            for i, (lines, entries) in enumerate(stacks.items())
        }
        (self.directory / "stack.json").write_text(json.dumps(stack_json, indent=1))


def export_msprobe(run: Run, out: str | Path, steps: list[int] | None = None,
                   ranks: list[int] | None = None, progress: Progress | None = None) -> list[Path]:
    """Write ``run`` under ``out`` in msprobe's layout; returns the ``dump.json`` paths."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ProbeError(f"{str(out)!r} is not empty; choose an empty directory for the export")
    chosen = [
        (step, rank)
        for rank in (ranks if ranks is not None else run.ranks)
        for step in (steps if steps is not None else run.steps_of(rank))
    ]
    exports = [_StepExport(run, s, r, out / f"step{s}" / f"rank{r}") for s, r in chosen]
    with nullcontext(progress) if progress is not None else Progress(transient=True) as bar:
        task_id = bar.add_task("exporting", total=sum(len(e.ops) for e in exports))
        for export in exports:
            export.write(bar, task_id)
    return [e.directory / "dump.json" for e in exports]
