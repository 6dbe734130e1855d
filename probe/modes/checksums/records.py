"""The checksums mode's records, as its reader returns them (``run.mode("checksums").checksums(step,
rank)``): what ``checksums.json`` holds for one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorChecksum:
    """One checksummed tensor: its name (a parameter's, or an input's path), dtype, shape and
    checksum (16 hex digits; None when it could not be computed)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str | None


@dataclass(frozen=True)
class InputCall:
    """The tensor arguments of one call of the model (root ``module``, ``call`` in the step)."""

    module: str
    call: int
    tensors: list[TensorChecksum]


@dataclass(frozen=True)
class StepChecksums:
    """What ``checksums.json`` holds for one step; each part None when it was not recorded."""

    step: int
    rank: int
    parameters: dict[str, TensorChecksum] | None
    inputs: list[InputCall] | None
    rng: dict[str, str] | None
    buffers: dict[str, TensorChecksum] | None = None
    """Recorded with the parameters (empty for a model without buffers); None in a step without
    them, and in runs written before buffers were recorded."""
