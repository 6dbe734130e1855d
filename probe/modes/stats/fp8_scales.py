"""The scales an fp8 op is given, recorded with its statistics.

An fp8 matmul's result is only as good as its scales: ``aten._scaled_mm(a, b, scale_a,
scale_b, scale_result=...)`` multiplies float8 operands and rescales. For every traced
op with a float8 tensor among its inputs, each tensor argument whose schema name
contains ``scale`` (``scale_a``, ``scale_b``, ``scale_result``; ``_scaled_grouped_mm``'s
too) is copied on its device when the op runs (its value then: delayed scaling updates scales in place) and
moved to the host with the step's statistics; no host sync.

Written per step to ``fp8_scales.jsonl`` and read as ``OpRecord.fp8_scales``:
``{name: {"shape": [...], "values": [...] or None, "min": v, "max": v}}`` (``values``
for scales of at most :data:`MAX_VALUES` elements: per-tensor and per-row scales of
small matrices; min and max always).

A float8 tensor subclass (torchao's ``Float8Tensor``) never reaches the probe as itself: the
tracer hands subclass calls back (``NotImplemented``) and records the plain ops the subclass
issues, its ``_scaled_mm`` with the scales as arguments among them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from probe.modes.stats.file_names import FP8_SCALES_FILE

FP8_DTYPES = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))
MAX_VALUES = 1024
"""Scales with more elements keep min and max only."""


_SCALE_ARGUMENTS: dict[int, tuple[Any, tuple[tuple[int, str], ...]]] = {}
"""Per op overload (by ``id``: an OpOverload hashes in Python, a call per lookup), the overload
itself (kept alive, so the id is not reused) and the (position, name) of its arguments named
like a scale; most ops have none."""


def _scale_positions(func: Any) -> tuple[tuple[int, str], ...]:
    entry = _SCALE_ARGUMENTS.get(id(func))
    if entry is None or entry[0] is not func:
        schema = getattr(func, "_schema", None)
        arguments = schema.arguments if schema is not None else ()
        entry = _SCALE_ARGUMENTS[id(func)] = (func, tuple(
            (i, a.name) for i, a in enumerate(arguments) if "scale" in a.name))
    return entry[1]


def scale_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                    inputs: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The scales of an fp8 op call, by name; empty for any other op (one dict lookup for an op
    without scale arguments)."""
    positions = _scale_positions(func)
    if not positions or not any(t.dtype in FP8_DTYPES for t in inputs):
        return []
    kwargs = kwargs or {}
    found = []
    for position, name in positions:
        value = args[position] if position < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


class Fp8Scales:
    """One step's recorded scales: device copies until the writer thread reads them."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, tuple[int, ...], torch.Tensor]] = []
        self.unscaled: set[str] = set()
        """Names of the op overloads met so far that have no scale argument (all but fp8 ones):
        the caller tests ``name not in unscaled`` before :meth:`add`, which then costs those ops
        no call at all (a name is one overload's)."""

    def add(self, op_index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
            inputs: list[torch.Tensor], op_name: str | None = None) -> None:
        """Copy the scales of op ``op_index`` (``func``), if it has any; ``op_name``: the name it
        is recorded under, remembered in :attr:`unscaled` when it has none."""
        if not _scale_positions(func):
            if op_name is not None:
                self.unscaled.add(op_name)
            return
        for name, scale in scale_arguments(func, args, kwargs, inputs):
            with torch.no_grad():
                flat = scale.detach().reshape(-1).to(torch.float64 if scale.device.type == "cpu"
                                                     else torch.float32, copy=True)
                if flat.numel() > MAX_VALUES:
                    flat = torch.stack([flat.amin(), flat.amax()])
            self.entries.append((op_index, name, tuple(scale.shape), flat))

    def take(self) -> list[tuple[int, str, tuple[int, ...], torch.Tensor]]:
        entries, self.entries = self.entries, []
        return entries


def scales_json(entries: list[tuple[int, str, tuple[int, ...], torch.Tensor]]) -> list[dict[str, Any]]:
    """The ``fp8_scales.jsonl`` objects (on the writer thread: the step's transfer)."""
    by_op: dict[int, dict[str, Any]] = {}
    for op_index, name, shape, flat in entries:
        values = flat.cpu().tolist()
        numel = math.prod(shape)
        entry: dict[str, Any] = {"shape": list(shape), "values": values if numel <= MAX_VALUES else None,
                                 "min": min(values, default=None), "max": max(values, default=None)}
        by_op.setdefault(op_index, {})[name] = entry
    return [{"i": i, "scales": scales} for i, scales in by_op.items()]


def write_file(writer: Any, entries: list[tuple[int, str, tuple[int, ...], torch.Tensor]]) -> dict[str, Any]:
    """Write ``fp8_scales.jsonl`` when the step recorded scales; the manifest summary's entry."""
    if not entries:
        return {}
    rows = scales_json(entries)
    writer.write_jsonl(FP8_SCALES_FILE, rows)
    return {"fp8_scaled_ops": len(rows)}


def attach_file(directory: Any, records: dict[int, Any], run: Any = None) -> None:
    """Set ``OpRecord.fp8_scales`` of the ops a step's ``fp8_scales.jsonl`` names (others keep None);
    ``run``: the run directory, which the file must lie in."""
    from probe.rundir.untrusted_reads import expect, read_jsonl, reading

    path = directory / FP8_SCALES_FILE
    for row in read_jsonl(path, run=run):
        with reading(path):
            op_index = expect(row.get("i"), int, "i")
            scales = expect(row.get("scales"), dict, "scales")
        record = records.get(op_index)
        if record is not None:
            record.fp8_scales = scales
