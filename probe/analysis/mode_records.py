"""What analysis reads of the records a mode's reader returns. The records are the modes' own
(``probe.modes.free_benchmark.records.CheckRecord``, ``probe.modes.monitor.records.MonitorRecord``
and ``AnomalyRecord``, ``probe.modes.checksums.records.StepChecksums``); analysis may not import a
mode, so it names the fields it reads here and gets the records through the run
(``run.mode(name)``, ``run.checks()``, ``run.anomalies()``)."""

from __future__ import annotations

from typing import Any, Protocol


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
