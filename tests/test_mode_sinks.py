"""Live output through the sinks the session offers (issue 34, item 3): the monitor writes its
series to whatever ``"tensorboard"`` sink the session hands it (``probe.modes.sinks``), imports
no exporter, and ``tensorboard=True`` is refused at the start when that sink cannot be written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import SharedBlockNet, train_steps

import probe
from probe import lifecycle
from probe.errors import ProbeError
from probe.modes.sinks import SinkKind


class RecordingSink:
    """A sink that keeps what it is given (the session's offer, swapped for this test's)."""

    opened: list[RecordingSink] = []

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.scalars: dict[int, dict[str, float]] = {}
        self.histograms: list[str] = []
        self.closed = False
        RecordingSink.opened.append(self)

    def add_scalars(self, step, tags, values) -> None:
        self.scalars.setdefault(step, {}).update(zip(tags, np.asarray(values).tolist(), strict=True))

    def add_histograms(self, step, histograms) -> None:
        self.histograms += [tag for tag, _, _ in histograms]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _offer(monkeypatch, kind: SinkKind) -> None:
    monkeypatch.setattr(lifecycle, "SERIES_SINKS", {kind.name: kind})


def test_the_monitor_writes_to_the_sink_the_session_offers(tmp_path, monkeypatch):
    RecordingSink.opened.clear()
    _offer(monkeypatch, SinkKind("tensorboard", reader_package=None, open=RecordingSink))
    model = SharedBlockNet()
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets={"head": {"output": "tensor"}},
                    histogram=True) as session:
        train_steps(model, 2, session)
    (sink,) = RecordingSink.opened
    assert sink.directory == tmp_path / "run" / "rank0" / "tensorboard"
    assert sink.closed
    run = probe.load(tmp_path / "run")
    for step in (0, 1):
        (row,) = [m for m in run.monitor(step) if m.name == "head" and m.slot == "output"]
        assert sink.scalars[step]["activation/head/output/norm"] == pytest.approx(row.norm, rel=1e-6)
        assert sink.scalars[step]["activation/head/output/zeros_share"] == row.distribution["zeros"]
    assert "activation/head/output/log2_magnitude" in sink.histograms


def test_tensorboard_true_is_refused_at_the_start_when_its_reader_is_missing(tmp_path, monkeypatch):
    _offer(monkeypatch, SinkKind("tensorboard", reader_package="probe_test_no_such_package",
                                 open=RecordingSink))
    model = SharedBlockNet()
    session = probe.mode("monitor", out=tmp_path / "run", model=model, targets=["head"], tensorboard=True)
    with pytest.raises(ProbeError, match="'tensorboard'=True: the 'probe_test_no_such_package' package"):
        session.start()
    # None (the default): written where its reader is installed, so here nothing, and no error.
    with probe.mode("monitor", out=tmp_path / "quiet", model=model, targets=["head"]) as session:
        train_steps(model, 1, session)
    assert not (tmp_path / "quiet" / "rank0" / "tensorboard").exists()
    assert probe.load(tmp_path / "quiet").monitor(0)
