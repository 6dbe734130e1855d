"""Queued statistics: reduced many tensors at a time, yet of the value each op produced."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

import probe
from probe.modes.statistics.capture import STAGE_MAX_NUMEL
from probe.modes.statistics.reduce import cpu_rows, device_rows

LARGE = 4 * STAGE_MAX_NUMEL  # queued, not staged


def _reference(t: torch.Tensor) -> list[float]:
    x = t.detach().to(torch.float64)
    return [x.min().item(), x.max().item(), x.sum().item(), (x * x).sum().item(),
            float(torch.isnan(x).sum()), float(torch.isinf(x).sum()), float(torch.isneginf(x).sum()),
            0.0]  # zeros: counted only where an eps is asked for (the monitor's)


def _close(row, ref, rel: float = 1e-5) -> None:
    for got, want in zip(row, ref, strict=True):
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == pytest.approx(want, rel=rel, abs=1e-3), (row, ref)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    bad = torch.randn(LARGE, generator=g)
    bad[[1, 5, 9]] = float("nan")
    bad[[2, 7]] = float("inf")
    bad[11] = float("-inf")
    return [
        torch.randn(LARGE, generator=g) * 3 + 1,
        torch.randn(512, 300, generator=g)[:, 7:250],  # strided slice
        bad,
        torch.full((LARGE,), torch.finfo(torch.float32).min),  # squares beyond fp32's range
    ]


def _cpu_eager_rows(xs):
    return cpu_rows(xs, compiled=False)


@pytest.mark.parametrize("rows", [cpu_rows, _cpu_eager_rows, device_rows])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_rows_match_fp64_reference(rows, dtype):
    xs = [t.to(dtype) for t in _tensors()]
    got = rows(xs)
    got = got.tolist()
    for row, x in zip(got, xs, strict=True):
        _close(row, _reference(x))  # in fp16 the fp32 mask is all -inf: sums -inf/inf, counts exact
    bad = got[2]
    assert bad[4] == 3 and bad[5] == 3 and bad[6] == 1  # exact NaN, Inf and -Inf counts


@pytest.mark.parametrize("compiled", [True, False])
def test_long_tensors_are_summed_in_fp64(compiled):
    x = torch.rand((1 << 21) + 3, generator=torch.Generator().manual_seed(4)) * 0.1 + 0.05
    row = cpu_rows([x], compiled=compiled)[0]
    wide = x.to(torch.float64)
    assert row[2] == pytest.approx(wide.sum().item(), rel=1e-10)
    assert row[3] == pytest.approx((wide * wide).sum().item(), rel=1e-10)


def test_in_place_writes_after_an_op_do_not_change_its_statistics(tmp_path):
    base = torch.randn(LARGE, generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=tmp_path / "r"):
        x = base.clone()
        x.mul_(2.0)
        x.add_(1.0)
        x.relu_()
    ops = probe.load(tmp_path / "r").ops(0)
    names = [op.name for op in ops]
    assert names == ["aten.clone.default", "aten.mul_.Tensor", "aten.add_.Tensor", "aten.relu_.default"]
    expected = [base, base * 2, base * 2 + 1, (base * 2 + 1).relu()]
    for op, value in zip(ops, expected, strict=True):
        stats = op.outputs[0].stats
        ref = _reference(value)
        assert stats["min"] == ref[0] and stats["max"] == ref[1]
        assert stats["mean"] == pytest.approx(ref[2] / value.numel(), rel=1e-5, abs=1e-6)
        assert stats["norm"] == pytest.approx(math.sqrt(ref[3]), rel=1e-6)


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_updates_in_place_keep_each_value(tmp_path, foreach):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # 65k weights: queued
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5, foreach=foreach)
    before = model.weight.detach().clone()
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        model(torch.randn(8, 256)).square().mean().backward()
        optimizer.step()
        session.step()
    ops = [op for op in probe.load(tmp_path / "r").ops(0) if op.phase == "optimizer"]
    weight_shape = tuple(model.weight.shape)
    # The first write of the weight is the weight decay (p *= 1 - lr * wd), the last the update.
    writes = [o for op in ops for o in op.outputs if o.shape == weight_shape and o.dtype == "float32"
              and op.name.startswith(("aten.mul_", "aten._foreach_mul_", "aten.addcdiv_",
                                      "aten._foreach_addcdiv_"))]
    assert len(writes) >= 2
    decayed = before * (1 - 0.1 * 0.5)
    assert writes[0].stats["max"] == pytest.approx(decayed.max().item(), rel=1e-6)
    assert writes[0].stats["norm"] == pytest.approx(decayed.norm().item(), rel=1e-5)
    final = model.weight.detach()
    assert writes[-1].stats["max"] == final.max().item()
    assert writes[-1].stats["norm"] == pytest.approx(final.norm().item(), rel=1e-5)
    assert writes[0].stats["norm"] != writes[-1].stats["norm"]


def test_queue_spills_in_batches_within_its_budget(tmp_path, monkeypatch):
    from probe.modes.statistics import capture

    monkeypatch.setitem(capture.QUEUE_BUDGET_BYTES, "cpu", 3 * LARGE * 4)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(LARGE, generator=g) * (i + 1) for i in range(10)]
    with probe.mode("stats", out=tmp_path / "r", ops=["aten.clone.default"]):
        clones = [v.clone() for v in values]
    records = probe.load(tmp_path / "r").ops(0)
    assert len(records) == len(clones)
    for op, value in zip(records, values, strict=True):
        assert op.outputs[0].stats["max"] == value.max().item()
        assert op.outputs[0].stats["norm"] == pytest.approx(value.norm().item(), rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_rows_on_cuda_match_the_reference():
    xs = [t.cuda() for t in _tensors()]
    for row, x in zip(device_rows(xs).tolist(), xs, strict=True):
        _close(row, _reference(x))


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("inputs", [False, True])
@pytest.mark.parametrize("budget", [None, 256 * 256 * 4])
def test_healthy_training_with_large_in_place_updates_warns_of_nothing(tmp_path, monkeypatch, foreach, inputs,
                                                                      budget):
    # Autograd counts an in-place write once the op returns, after the probe saw it: the
    # version a queued result is checked against is the one it has then, for views too
    # (a view gets its base's counter only then). A budget spent by an op's result is
    # reduced before the next op, once that count is in. No false "wrote into them" alarm.
    from probe.modes.statistics import capture

    if budget is not None:  # every weight-sized result spends it
        monkeypatch.setitem(capture.QUEUE_BUDGET_BYTES, "cpu", budget)
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=foreach)
    with warnings.catch_warnings():
        warnings.simplefilter("error", probe.ProbeWarning)
        with probe.mode("stats", out=tmp_path / "r", inputs=inputs) as session:
            for _ in range(2):
                weight = model.weight.detach().clone()
                model(torch.randn(8, 256)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                session.step()
    transposed = next(op for op in probe.load(tmp_path / "r").ops(1)
                      if op.name == "aten.t.default" and op.phase == "forward").outputs[0].stats
    assert transposed["max"] == weight.max().item()  # the weight the step's forward used


def test_an_input_the_op_writes_keeps_the_value_it_had_before(tmp_path):
    base = torch.randn(LARGE, generator=torch.Generator().manual_seed(3))
    x = base.clone()  # made before: its first reading is as the input of mul_
    with probe.mode("stats", out=tmp_path / "r", inputs=True):
        x.mul_(2.0)
    mul = probe.load(tmp_path / "r").ops(0)[0]
    assert mul.name == "aten.mul_.Tensor"
    assert mul.inputs[0].stats["max"] == base.max().item()
    assert mul.outputs[0].stats["max"] == (base * 2).max().item()


@pytest.mark.parametrize("through_view", [False, True])
def test_a_write_the_stats_mode_does_not_see_is_still_told(tmp_path, through_view):
    # mul_ is filtered out: it writes a queued result unseen. Through a view too: the check
    # reads the counter autograd gives the view, not the one it had inside the dispatch.
    base = torch.randn(512, 256, generator=torch.Generator().manual_seed(5))
    recorded = "aten.t.default" if through_view else "aten.clone.default"
    with (pytest.warns(probe.ProbeWarning, match="not measured: an op the stats mode does not see"),
          probe.mode("stats", out=tmp_path / "r", ops=[recorded])):
        x = base.clone()
        _ = x.t()
        x.mul_(2.0)
    (op,) = probe.load(tmp_path / "r").ops(0)
    assert op.name == recorded
    assert op.outputs[0].stats is None  # the value it had is gone: not measured, never a later value


def test_memory_freed_outside_any_op_is_recorded_as_not_measured(tmp_path):
    base = torch.randn(LARGE, generator=torch.Generator().manual_seed(6))
    with (pytest.warns(probe.ProbeWarning, match="not measured: their memory was freed"),
          probe.mode("stats", out=tmp_path / "r", ops=["aten.clone.default"]) as session):
        for step in range(2):
            x = base.clone()
            kept = base.clone()
            if step == 0:
                x.untyped_storage().resize_(0)  # no op: the dispatch mode cannot see it
            session.step()
    run = probe.load(tmp_path / "r")
    freed, other = (op.outputs[0].stats for op in run.ops(0))
    assert freed is None  # not a made-up row, not a read of freed memory
    assert other["max"] == base.max().item()
    assert run.step_info(0).manifest["modes"]["stats"]["unmeasured_tensors"] == 1
    assert "unmeasured_tensors" not in run.step_info(1).manifest["modes"]["stats"]
    assert all(op.outputs[0].stats["max"] == base.max().item() for op in run.ops(1))
    del kept
    from probe.analysis.summary import summarize_step
    from probe.exporters.console import make_console, render_step

    shown = io.StringIO()
    render_step(make_console(shown), summarize_step(run, 0, 0))
    assert "first non-finite op: none among the measured (1 tensor(s) not measured" in shown.getvalue()


def test_a_tensor_one_run_could_not_measure_is_not_compared_never_passed(tmp_path):
    base = torch.randn(LARGE, generator=torch.Generator().manual_seed(7))
    for name, free in (("a", False), ("b", True)):
        with warnings.catch_warnings(), probe.mode("stats", out=tmp_path / name,
                                                   ops=["aten.clone.default", "aten.mul.Tensor"]) as session:
            warnings.simplefilter("ignore", probe.ProbeWarning)
            x = base.clone()
            _ = x * 2
            if free:
                x.untyped_storage().resize_(0)
            session.step()
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    clone, mul = report.comparisons
    assert clone.verdict == "not compared" and "no statistics in run B" in clone.message
    assert mul.verdict == "pass"
    assert not report.ok  # --fail-on-divergence fails: not everything was compared


@pytest.mark.parametrize("threads", [1, 2])
def test_the_compiled_pass_split_across_threads_sums_in_fp64(threads):
    # From PARALLEL_MIN_NUMEL on, the pass runs on torch's intra-op threads (partial sums per
    # thread, combined in fp64): the same exactness as one thread's pass.
    from probe.modes.statistics.reduce import PARALLEL_MIN_NUMEL

    x = torch.rand(4 * PARALLEL_MIN_NUMEL + 5, generator=torch.Generator().manual_seed(8)) * 0.1 + 0.05
    x[17] = -3.0
    x[-2] = 7.5
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        row = cpu_rows([x])[0]
    finally:
        torch.set_num_threads(saved)
    wide = x.to(torch.float64)
    assert (row[0], row[1]) == (-3.0, 7.5)
    assert row[2] == pytest.approx(wide.sum().item(), rel=1e-12)
    assert row[3] == pytest.approx((wide * wide).sum().item(), rel=1e-12)


def _stats_summary(out) -> dict:
    return probe.load(out).step_info(0).manifest["modes"]["stats"]


def test_a_weight_and_its_transpose_read_from_outside_share_one_row(tmp_path):
    # A linear layer reads its weight as it is and transposed (forward and backward): the same
    # elements, reduced once.
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(256, 512, generator=g)
    transposed = weight.t()  # made outside the step: both are inputs from outside it
    x = torch.randn(4, 256, generator=g)
    with probe.mode("stats", out=tmp_path / "r"):
        torch.mm(x, weight)
        torch.mm(transposed, x.t())
    first, second = (op for op in probe.load(tmp_path / "r").ops(0) if op.name == "aten.mm.default")
    assert first.inputs[1].stats == second.inputs[0].stats
    assert first.inputs[1].stats["max"] == weight.max().item()
    assert first.inputs[1].stats["norm"] == pytest.approx(weight.norm().item(), rel=1e-6)
    # x and x.t() (a view op in the step) share a row too: x, the weight, two products.
    assert _stats_summary(tmp_path / "r")["rows"] == 4


def test_an_unsafe_view_takes_its_input_row(tmp_path):
    base = torch.randn(LARGE, generator=torch.Generator().manual_seed(10))
    with probe.mode("stats", out=tmp_path / "r"):
        y = base * 2
        z = torch.ops.aten._unsafe_view(y, (LARGE // 4, 4))
        z.mul_(3.0)  # a write after: z's and y's rows keep the value they had
    mul, view, mul_ = probe.load(tmp_path / "r").ops(0)
    assert view.name == "aten._unsafe_view.default"
    assert view.outputs[0].stats == mul.outputs[0].stats
    assert view.outputs[0].stats["max"] == (base * 2).max().item()
    assert mul_.outputs[0].stats["max"] == (base * 6).max().item()
    assert _stats_summary(tmp_path / "r")["rows"] == 3  # base, y (= z), z after mul_


def _c_calls_during(fn, name: str) -> int:
    """How many times the C method ``name`` is called while ``fn()`` runs (``sys.setprofile``)."""
    import sys

    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "c_call" and getattr(arg, "__name__", None) == name:
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_a_queued_tensor_storage_is_looked_up_once_at_capture_and_once_when_reduced():
    # Per-tensor host work of the capture queue: the storage is read at capture (its identity and
    # address, kept in the queue entry) and at reduction (are the bytes still there); every other
    # use reads the entry. It was five lookups a tensor, on the hot path of every op's result.
    from probe.modes.statistics.capture import StepRows
    from probe.modes.statistics.reduce import TensorStats

    rows = StepRows(TensorStats(), stage=False, saturation=False, queue=True)
    xs = [torch.randn(STAGE_MAX_NUMEL + 1) for _ in range(5)]
    rows.add(xs[0])
    rows.flush()  # the kernel's first use compiles it (which reads storages of its own)
    ids: list[int | None] = []

    def capture_and_reduce() -> None:
        ids.extend(rows.add(x) for x in xs)
        rows.flush()

    assert _c_calls_during(capture_and_reduce, "untyped_storage") == 2 * len(xs)
    raw, numel, _ = rows.end_step().to_host()
    for i, x in zip(ids, xs, strict=True):  # still each tensor's own statistics
        assert raw[i, 0] == x.min().item() and raw[i, 1] == x.max().item()
        assert numel[i] == x.numel()
