"""The layout of DTensor ops: which mesh and placements the local ops the tracer records ran for.

A dispatch mode is called before a tensor subclass: for an op on DTensors the mode sees the
DTensor-level call first (``aten.addmm`` with a ``Shard(0)`` bias, a ``Replicate`` input and a
``Shard(1)`` weight), and the local ops DTensor then issues on plain tensors (the
redistributions its sharding propagation asks for, the local ``addmm``) come back through the
mode one by one. The DTensor call's result, and so its placements, is never seen when the mode
just returns ``NotImplemented``. So the mode runs the DTensor op itself, with itself pushed back
(the one re-entry of the same call returns ``NotImplemented``, and DTensor's own dispatch runs),
and labels the local ops recorded meanwhile with the call's mesh and placements
(:data:`probe.tracer.op_call.LayoutMeta`): the last local op of the DTensor op's name is its
``compute`` op, the others ``redistribute`` ops. A DTensor op that DTensor decomposes into other
DTensor ops labels what its inner calls did not.
"""

from __future__ import annotations

import sys
from typing import Any

from probe.rundir.op_record_fields import (
    RECORD_FIELD_INDEX,
    RECORD_LAYOUT,
    LayoutMeta,
    MeshMeta,
    OpRecordTuple,
    Placements,
)
from probe.vocabulary.op_tensors import tensors_in, tensors_out

_NAME = RECORD_FIELD_INDEX["name"]


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` once something imported it (a program using
    DTensor has), else None: the probe never imports it itself."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def placement_name(placement: Any) -> str:
    """``"S(d)"``, ``"R"``, ``"P(<reduce op>)"``; a strided shard as ``"_S(d,split)"``; another
    placement by its ``str``."""
    kind = type(placement).__name__
    if kind == "Shard":
        return f"S({placement.dim})"
    if kind == "_StridedShard":
        return f"_S({placement.dim},{placement.split_factor})"
    if kind == "Replicate":
        return "R"
    if kind in ("Partial", "_NormPartial", "MaskPartial"):
        return f"P({getattr(placement, 'reduce_op', 'sum')})"
    return str(placement)


class LayoutLabeller:
    """Mesh and placements of DTensor calls, put on the records of the local ops they ran."""

    def __init__(self) -> None:
        self._meshes: dict[int, tuple[Any, MeshMeta]] = {}
        """id(mesh) -> (the mesh, kept alive so the id stays its own; its description)."""

    def _mesh(self, mesh: Any) -> MeshMeta:
        known = self._meshes.get(id(mesh))
        if known is None or known[0] is not mesh:
            names = getattr(mesh, "mesh_dim_names", None)
            ranks = mesh.mesh.flatten().tolist()
            known = self._meshes[id(mesh)] = (
                mesh, (tuple(mesh.mesh.shape), None if names is None else tuple(names), tuple(ranks)))
        return known[1]

    def _placements(self, values: list[Any], dtensor: type) -> tuple[Placements, ...]:
        return tuple(tuple(placement_name(p) for p in v.placements) if isinstance(v, dtensor) else None
                     for v in values)

    def label(self, records: list[OpRecordTuple], start: int, name: str, args: tuple, kwargs: dict,
              out: Any, dtensor: type) -> None:
        """Label records ``start:`` not labelled yet (by an inner DTensor call) with this call's layout."""
        unlabelled = [i for i in range(start, len(records)) if records[i][RECORD_LAYOUT] is None]
        if not unlabelled:
            return
        ins = tensors_in(args, kwargs)
        mesh = next((t.device_mesh for t in ins if isinstance(t, dtensor)), None)
        outs = tensors_out(out)
        if mesh is None:
            mesh = next((t.device_mesh for t in outs if isinstance(t, dtensor)), None)
        if mesh is None:
            return
        mesh_meta = self._mesh(mesh)
        in_placements = self._placements(ins, dtensor)
        out_placements = self._placements(outs, dtensor)
        # The compute op: the last local op of the DTensor op's own name (else the last one).
        compute = next((i for i in reversed(unlabelled) if records[i][_NAME] == name), unlabelled[-1])
        for i in unlabelled:
            role = "compute" if i == compute else "redistribute"
            layout: LayoutMeta = (name, role, mesh_meta, in_placements, out_placements)
            records[i] = (*records[i][:RECORD_LAYOUT], layout, *records[i][RECORD_LAYOUT + 1:])  # type: ignore[assignment]
