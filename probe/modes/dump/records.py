"""The dump's records: the entries of a step's dump index (``tensors.json``), read back by
:class:`probe.modes.dump.files.DumpIndex`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DumpedTensor:
    """One entry of a step's dump index."""

    op: int
    io: str
    position: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    blob: int | None
    offset: int
    checksum: int | None
    status: str | None
    """None when the bytes are on disk; otherwise why not (skipped, lost, not dumpable)."""
    conj: bool = False
    neg: bool = False
    """A conjugate / negative view: its values are its bytes conjugated / negated (dump mode)."""
    layout: str = "strided"
    """How it is stored: ``"strided"``, the view above of one blob; otherwise a layout of
    ``probe.rundir.tensor_layouts`` (``"sparse_csr"``, ``"nested"``, ...) stored as :attr:`parts`
    (its ``stride`` is then ``()``)."""
    parts: dict[str, DumpedPart] = field(default_factory=dict)
    """Name -> the strided tensor it is stored as (``tensor_layouts`` names them)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The numbers of its layout beside its parts (a scale, an axis; ``tensor_layouts``)."""


@dataclass(frozen=True)
class DumpedPart:
    """One strided part of a dumped tensor stored in parts: a view of its blob's bytes."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    blob: int | None
    """None for an empty part."""
    offset: int
    conj: bool = False
    neg: bool = False
