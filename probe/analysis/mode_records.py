"""What analysis reads of the records a mode's reader returns. The records are the modes' own
(``probe.modes.free_benchmark.records.CheckRecord``, ``probe.modes.monitor.records.MonitorRecord``
and ``AnomalyRecord``, ``probe.modes.checksums.records.StepChecksums``,
``probe.modes.stats.records.NonfiniteParameterRecord``, the dump's ``DumpIndex`` and its
``probe.modes.dump.records.DumpedTensor``); analysis may not import a mode, so it names the fields
it reads here and gets the records through the run (``run.mode(name)``, ``run.checks()``,
``run.anomalies()``, ``run.dump()``, ``run.nonfinite_parameters()``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class Check(Protocol):
    """One free-benchmark check of one op output."""

    step: int
    rank: int
    op_id: str
    perturb: str
    verdict: str
    dtype: str | None
    ratio: float | None
    threshold: float | None
    nonfinite_mismatch: int
    sign_flips: int


class Alert(Protocol):
    """One monitor alert."""

    step: int
    rank: int
    module: str
    metric: str
    value: float
    baseline: float | None
    rule: str
    kind: str
    call: int
    reason: str
    incident: int | None

    def describe(self) -> str: ...


class AlertReader(Protocol):
    """The part of the monitor's run reader (``run.mode("monitor")``) analysis calls."""

    def alert(self, row: dict[str, Any]) -> Alert: ...


class TensorChecksum(Protocol):
    """One checksummed tensor: a parameter's, a buffer's or an input's."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: str | None


class InputCall(Protocol):
    """The tensor arguments of one call of the model."""

    module: str
    call: int
    tensors: list[TensorChecksum]


class StepChecksums(Protocol):
    """What the checksums mode recorded for one step; each part None when it was not recorded."""

    step: int
    rank: int
    parameters: dict[str, TensorChecksum] | None
    inputs: list[InputCall] | None
    rng: dict[str, str] | None
    buffers: dict[str, TensorChecksum] | None


class ChecksumsOfRun(Protocol):
    """The part of the checksums mode's run reader (``run.mode("checksums")``) analysis calls."""

    def checksums(self, step: int | None = None, rank: int | None = None) -> StepChecksums | None: ...


class NonfiniteParameters(Protocol):
    """The parameters and gradients one step found holding NaN or Inf (the stats mode's)."""

    step: int
    rank: int
    parameters: tuple[list[str], int] | None
    gradients: tuple[list[str], int] | None

    def describe(self, names_shown: int = 5) -> list[str]: ...


class DumpEntry(Protocol):
    """One tensor of a step's dump index: ``status`` None when its bytes are on disk, else why not."""

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def stride(self) -> tuple[int, ...]: ...

    @property
    def status(self) -> str | None: ...

    @property
    def layout(self) -> str: ...


class StepDump(Protocol):
    """The dump of one step (``run.dump(step, rank)``), or a folded step's (``LogicalDump``)."""

    @property
    def complete(self) -> bool: ...

    @property
    def entries(self) -> Mapping[tuple[int, str, int], DumpEntry]: ...

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor: ...

    def call(self, op: int) -> dict[str, Any]: ...
