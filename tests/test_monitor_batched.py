"""The monitor's batched reduction and its event writer: hooks queue tensors, batches are
reduced later with the values they had at capture (tensors changed in place included),
held tensors are bounded by a byte budget, and the TensorBoard events (one per step,
written by probe's own writer) read back in TensorBoard."""

from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.errors import ProbeWarning
from probe.modes.statistics import columns
from probe.modes.statistics.capture import StepRows
from probe.modes.statistics.finalize import whole
from probe.modes.statistics.reduce import TensorStats, as_real, zeros_threshold
from tests.conftest import SharedBlockNet, train_steps


class InPlaceNet(nn.Module):
    """``a``'s output is changed in place by its parent after ``a`` returns (``out += 1``), at
    the steps in ``inplace_steps`` (every step when None)."""

    def __init__(self, inplace_steps: set[int] | None = None, hidden: int = 1 << 14) -> None:
        super().__init__()
        # a's output (4 x hidden) larger than a staged tensor: queued by reference, as it was
        # captured only while nothing writes it (a staged one is copied at capture).
        self.a = nn.Linear(8, hidden)
        self.b = nn.Linear(hidden, 3)
        self.inplace_steps = inplace_steps
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.inplace_steps is None or self.calls in self.inplace_steps:
            h += 1.0
        self.calls += 1
        return self.b(torch.relu(h))


def _train_recording(tmp_path, model, steps, **options):
    """Train under the monitor; also keep a copy of ``a``'s output as ``a`` returned it."""
    seen = []
    model.a.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    with probe.mode("monitor", out=tmp_path / "run", model=model, **options) as session:
        train_steps(model, steps, session=session)
    return probe.load(tmp_path / "run"), seen


def _assert_row_is(row, t: torch.Tensor) -> None:
    x = t.double()
    for metric, want in (("min", x.min()), ("max", x.max()), ("mean", x.mean()), ("norm", x.norm())):
        assert getattr(row, metric) == pytest.approx(want.item(), rel=1e-6), metric


def test_an_output_changed_in_place_after_capture_is_reported_as_it_was(tmp_path, recwarn):
    run, seen = _train_recording(tmp_path, InPlaceNet(), 4, targets={"a": {"output": "tensor"}})
    for step in range(4):
        (row,) = run.monitor(step)
        _assert_row_is(row, seen[step])  # not seen[step] + 1
    # Learned in the first step (reduced there at capture): never an unknown value.
    assert not [w for w in recwarn if "changed in place" in str(w.message)]


def test_a_series_first_changed_in_place_later_is_unknown_that_step_then_reduced_at_capture(tmp_path):
    with pytest.warns(ProbeWarning, match=r"activation a output was changed in place"):
        run, seen = _train_recording(tmp_path, InPlaceNet(inplace_steps={2, 3}), 4,
                                     targets={"a": {"output": "tensor"}})
    for step in (0, 1, 3):
        (row,) = run.monitor(step)
        _assert_row_is(row, seen[step])
    (row,) = run.monitor(2)
    assert math.isnan(row.norm) and math.isnan(row.mean) and row.nan == 0 and row.numel == seen[2].numel()
    assert run.anomalies() == []  # an unknown value is not an alert


def test_batched_values_equal_a_direct_recomputation_after_the_first_step(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    seen: dict[tuple[str, str, int], torch.Tensor] = {}
    calls = {"step": 0, "block.fc": 0}

    def capture(name):
        def hook(module, args, out):
            call = 0
            if name == "block.fc":
                call, calls[name] = calls[name] % 2, calls[name] + 1
            if calls["step"] == 2:
                seen[(name, "output", call)] = out.detach().clone()
                out.register_hook(lambda g: seen.__setitem__((name, "output_grad", call), g.clone()))

        return hook

    for name in ("inp", "block.fc", "head"):
        model.get_submodule(name).register_forward_hook(capture(name))

    class Stepper:
        def step(self):
            session.step()
            calls["step"] += 1

    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["inp", "block.fc", "head"],
                    tensorboard=False) as session:
        train_steps(model, 3, session=Stepper())
    rows = {(m.name, m.slot, m.call): m for m in probe.load(tmp_path / "run").monitor(2)}
    assert set(rows) == set(seen) and len(rows) == 8
    for key, row in rows.items():
        _assert_row_is(row, seen[key])
        assert row.zeros == float((seen[key].abs() < 1e-8).sum()) and row.nan == 0


def _assorted() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(5, 7), torch.randn(3, dtype=torch.bfloat16), torch.randn(4, dtype=torch.float16),
            torch.tensor([1.0, math.nan, math.inf, 0.0]), torch.tensor([-math.inf, 2.0]),
            torch.randn(4, 1).expand(4, 6),  # a broadcast view: each element counted 6 times
            torch.randn(2, 3, dtype=torch.complex64), torch.empty(0), torch.randn(6, 5).t(),
            torch.tensor(3.0),
            torch.zeros(3, dtype=torch.float64), torch.tensor([1e-8, 5e-9, -1e-9, 2e-8]),
            torch.tensor([1e300, -1e300], dtype=torch.float64), torch.randn(40000)]


def _reference(t: torch.Tensor, eps: float) -> np.ndarray:
    """The whole tensor's raw row by the statistics table's own eager forms, in fp64."""
    x = as_real(t).reshape(-1).to(torch.float64)
    return columns.raw_row(x, zeros_threshold(t.dtype, eps)).numpy()


ENGINES = {  # the capture queue as the monitor uses it (staged; queued for reduce_ranks; learning)
    # and as the stats mode's backends do
    "staged": {"stage": True}, "queued": {"stage": False, "queue": True},
    "learning": {"stage": True, "learning": True}, "one_by_one": {"stage": False, "queue": False},
}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_path_of_the_engine_gives_the_tables_row(engine):
    options = dict(ENGINES[engine])
    learning = options.pop("learning", False)
    rows = StepRows(TensorStats(), saturation=False, eps=1e-8, **options)
    rows.learning = learning
    tensors = _assorted()
    with torch.no_grad():
        ids = [rows.add(t) for t in tensors]
        raw, numel = whole(*rows.end_step().to_host())
    for t, row in zip(tensors, ids, strict=True):
        assert numel[row] == as_real(t).numel()
        if t.numel() == 0:
            continue
        np.testing.assert_allclose(raw[row], _reference(t, 1e-8), rtol=1e-12, atol=0, equal_nan=True)


def test_held_tensors_are_released_when_the_byte_budget_is_reached():
    rows = StepRows(TensorStats(), stage=False, saturation=False, queue=True, eps=1e-8, budget=1000)
    tensors = [torch.randn(100) for _ in range(3)]  # 400 bytes each
    expected = [_reference(t, 1e-8) for t in tensors]
    first = weakref.ref(tensors[0])
    for t in tensors:
        rows.add(t)
        rows.settle()  # as the monitor's capture does
    del tensors, t
    gc.collect()
    assert first() is None  # the third capture passed the budget: the batch was reduced and let go
    raw, _, _ = rows.end_step().to_host()
    assert np.allclose(raw, np.stack(expected), rtol=1e-12, atol=0)


def test_one_tensorboard_event_per_step_read_back_by_tensorboard(tmp_path):
    event_file_loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc

    from probe.exporters import tensorboard_events

    data = bytes(range(256)) * 3
    assert tensorboard_events.masked_crc32c(data) == tensorboard_crc(data)
    assert tensorboard_events._table_crc32c(data) == tensorboard_events.crc32c(data)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["inp", "head"],
                    metrics=["norm", "max", "id"], tensorboard=True) as session:
        train_steps(model, 3, session=session)
    (path,) = (tmp_path / "run" / "rank0" / "tensorboard").iterdir()
    # Raw: the non-raw loader rewrites simple_value into tensors (as TensorBoard shows them).
    events = [Event.FromString(r) for r in event_file_loader.RawEventFileLoader(str(path)).Load()]
    assert events[0].file_version == "brain.Event:2"
    assert [e.step for e in events[1:]] == [0, 1, 2]  # one event per step
    run = probe.load(tmp_path / "run")
    for event in events[1:]:
        values = {v.tag: v.simple_value for v in event.summary.value}
        rows = run.monitor(event.step)
        assert len(values) == 2 * len(rows)  # norm and max; no "id": no one-element series
        for row in rows:
            prefix = f"activation/{row.name}/{row.slot}"
            assert values[f"{prefix}/norm"] == pytest.approx(row.norm, rel=1e-6)
            assert values[f"{prefix}/max"] == pytest.approx(row.max, rel=1e-6)
