"""The probe never raises into training: not from memory its statistics would need, not from a
warning a filter turns into an error, not from torch's warnings about the probe's own hooks.

- Statistics of a large tensor are computed a piece at a time (``statistics.pieces``): no
  temporary of the tensor's size (a widened copy, a contiguous copy, a mask, a bin index per
  element), results within 1e-7 of exact fp64 (counts exact), bit-identical where the tensor
  is one piece. Measured here with torch's profiler (the largest block the CPU allocator hands
  out) at a lowered piece size, and with the process's peak RSS at the real one.
- ``warnings.simplefilter("error")`` (pytest's ``filterwarnings = error``): a ``ProbeWarning``
  is logged on the ``probe`` logger instead of raised, and a ``torch.compile``d model trains.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import probe
from probe import errors
from probe.errors import ProbeWarning
from probe.modes.statistics import pieces
from probe.modes.statistics import reduce as reduce_module
from probe.modes.statistics.columns import RAW_COLUMNS
from probe.modes.statistics.distribution import dtype_range, exponent_counts, share_counts
from probe.modes.statistics.reduce import TensorStats, adam_update_row, cpu_rows, device_rows
from tests.conftest import train_steps

PIECE = 1 << 15  # the compiled kernels' threshold: pieces take the compiled paths too
NUMEL = 40 * PIECE + 7  # the last piece is short
MIN, MAX, SUM, SUMSQ, NAN, INF, NINF, ZEROS = range(len(RAW_COLUMNS))
REL = 1e-7


def _largest_allocation(fn: Callable[[], object]) -> int:
    """The largest block torch's CPU allocator handed out while ``fn`` ran, in bytes."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def _tensor(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "int8":
        return torch.randint(-128, 128, (NUMEL,), dtype=torch.int8, generator=g)
    if kind == "float8":
        return (torch.randn(NUMEL, generator=g) * 4).to(torch.float8_e4m3fn)
    base = torch.randn(NUMEL, generator=g) * 3 + 1
    if kind == "fp16":
        return base.half()
    if kind == "fp16 with nan and inf":
        x = base.half()
        x[5], x[NUMEL // 2], x[-1] = math.nan, math.inf, -math.inf
        return x
    if kind == "fp32 with gaps":  # a slice with gaps: [rows, 2 of 3 columns]
        return torch.randn(NUMEL, 3, generator=g)[:, :2]
    raise AssertionError(kind)


def _exact_row(x: torch.Tensor, eps: float | None = None) -> list[float]:
    """The raw row in fp64 (exact at these sizes; ``eps`` as the kernels compare it)."""
    w = x.to(torch.float64).reshape(-1)
    zeros = 0 if eps is None else int((w.abs() < eps).sum())
    return [float(w.amin()), float(w.amax()), float(w.sum()), float((w * w).sum()),
            int(torch.isnan(w).sum()), int(torch.isinf(w).sum()), int(torch.isneginf(w).sum()), zeros]


def _check_row(got: np.ndarray, want: list[float], columns: range = range(len(RAW_COLUMNS))) -> None:
    for c in columns:
        g, w = float(got[c]), want[c]
        if math.isnan(w) or math.isinf(w) or c not in (SUM, SUMSQ):
            assert g == w or (math.isnan(g) and math.isnan(w)), (RAW_COLUMNS[c], g, w)
        else:
            assert abs(g - w) <= REL * abs(w), (RAW_COLUMNS[c], g, w)


def _row_cases() -> dict[str, tuple[str, Callable[[torch.Tensor], np.ndarray], float | None]]:
    """name -> (tensor kind, reduction to a raw row on the host, eps)."""
    return {
        "TensorStats auto, int8 (was widened whole for the compiled pass)":
            ("int8", lambda x: TensorStats().row(x).numpy(), None),
        "TensorStats eager, int8 (was widened whole to fp64)":
            ("int8", lambda x: TensorStats("eager").row(x).numpy(), None),
        "TensorStats auto, a slice with gaps (was copied whole)":
            ("fp32 with gaps", lambda x: TensorStats().row(x).numpy(), None),
        "TensorStats saturated (an NPU's), fp16":
            ("fp16", lambda x: TensorStats().row(x, saturated=True).numpy(), None),
        "cpu_rows, fp16 (was widened whole to fp32)":
            ("fp16", lambda x: cpu_rows([x])[0], None),
        "cpu_rows without the compiler, a slice with gaps (sums widened it whole)":
            ("fp32 with gaps", lambda x: cpu_rows([x], compiled=False)[0], None),
        "cpu_rows' exact pass for non-finite rows, fp16":
            ("fp16 with nan and inf", lambda x: cpu_rows([x])[0], None),
        "cpu_rows with the monitor's eps, fp16 (the zeros count widened it whole)":
            ("fp16", lambda x: cpu_rows([x], eps=1e-2)[0], 1e-2),
        "device_rows' foreach reductions, fp16 (negated copies and masks)":
            ("fp16", lambda x: device_rows([x], stats=TensorStats("eager"))[0].numpy(), None),
    }


ROW_CASES = _row_cases()


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_statistics_of_a_large_tensor_are_reduced_piece_by_piece(case, monkeypatch):
    kind, reduce_row, eps = ROW_CASES[case]
    x = _tensor(kind)
    whole = reduce_row(x)  # one piece (the default size is larger): the path as it always was
    monkeypatch.setattr(pieces, "PIECE_NUMEL", x.numel())
    assert np.array_equal(reduce_row(x), whole, equal_nan=True)  # exactly one piece: bit for bit
    monkeypatch.setattr(pieces, "PIECE_NUMEL", PIECE)
    got = reduce_row(x)  # (compiles what a piece needs, once per process)
    largest = _largest_allocation(lambda: reduce_row(x))
    # A piece widened to fp64 is the largest thing made; the tensor is 40 pieces.
    assert largest <= 8 * PIECE, f"{case}: a temporary of {largest} bytes for {x.numel()} elements"
    want = _exact_row(x, None if eps is None else float(np.float32(eps)))
    _check_row(got, want)
    _check_row(whole, want)


def _share_counts_exact(x: torch.Tensor) -> list[float]:
    if not x.is_floating_point():
        return [int((x == 0).sum()), math.nan, math.nan]
    r = dtype_range(x.dtype)
    a = x.to(torch.float64).abs()
    return [int((a == 0).sum()), int(((a > 0) & (a < r.tiny)).sum()),
            int(((a > r.half_max) & (a != math.inf)).sum())]


@pytest.mark.parametrize("kind", ["int8", "fp32 with gaps", "float8"])
def test_distribution_shares_of_a_large_tensor_are_counted_piece_by_piece(kind, monkeypatch):
    x = _tensor(kind)
    monkeypatch.setattr(pieces, "PIECE_NUMEL", PIECE)
    got = share_counts(x)
    assert _largest_allocation(lambda: share_counts(x)) <= 8 * PIECE
    for g, w in zip(got.tolist(), _share_counts_exact(x), strict=True):
        assert g == w or (math.isnan(g) and math.isnan(w)), (kind, got, w)


def test_histogram_of_a_large_tensor_is_counted_piece_by_piece(monkeypatch):
    x = _tensor("fp16")
    x[3] = 0
    whole = exponent_counts(x)  # one piece: an int64 bin index per element
    monkeypatch.setattr(pieces, "PIECE_NUMEL", PIECE)
    got = exponent_counts(x)
    assert _largest_allocation(lambda: exponent_counts(x)) <= 8 * PIECE
    assert torch.equal(got, whole)
    assert int(got.sum()) == NUMEL and int(got[0]) == int((x == 0).sum())


def test_adam_update_without_the_compiler_is_reduced_piece_by_piece(monkeypatch):
    g = torch.Generator().manual_seed(1)
    m, v = torch.randn(NUMEL, generator=g) * 1e-3, torch.rand(NUMEL, generator=g) * 1e-6
    # The compiled kernel unavailable on the CPU, as after a failed compile (no C++ compiler).
    monkeypatch.setattr(reduce_module._ADAM_UPDATE, "failed_devices", {"cpu"})
    monkeypatch.setattr(pieces, "PIECE_NUMEL", PIECE)
    args = (1e-3, 0.9, 0.999, 1e-8, 10, 1e-6)
    row, numel = adam_update_row(m, v, *args)
    assert _largest_allocation(lambda: adam_update_row(m, v, *args)) <= 8 * PIECE
    # The update as the kernel makes it (in fp32), then reduced exactly.
    coefficients = torch.tensor([1e-3 / (1 - 0.9**10), 1 / (1 - 0.999**10), 1e-8], dtype=torch.float32)
    update = coefficients[0] * m / ((v * coefficients[1]).sqrt() + coefficients[2])
    assert numel == NUMEL
    _check_row(row.numpy(), _exact_row(update, float(np.float32(1e-6))))


def test_the_stats_mode_reads_back_exact_statistics_of_a_tensor_of_many_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(pieces, "PIECE_NUMEL", PIECE)
    x = _tensor("int8")
    with probe.mode("stats", out=tmp_path / "warm") as session:  # compiles what a piece needs
        x.abs()
        session.step()

    def traced() -> None:
        nonlocal y
        with probe.mode("stats", out=tmp_path / "run") as session:
            y = x.abs()
            session.step()

    y = torch.empty(0)
    largest = _largest_allocation(traced)
    # The op's own output (NUMEL bytes) is the largest block; before, the int8 tensor widened
    # to fp32 for the compiled pass was four times that.
    assert largest < 2 * NUMEL, largest
    op = next(op for op in probe.load(tmp_path / "run").ops(step=0, rank=0) if op.name == "aten.abs.default")
    w = y.to(torch.float64)
    stats = op.outputs[0].stats
    assert (stats["min"], stats["max"]) == (float(w.min()), float(w.max()))
    assert abs(stats["mean"] - float(w.mean())) <= REL * abs(float(w.mean()))
    assert abs(stats["norm"] - float(w.norm())) <= REL * float(w.norm())


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch, probe

    def rss_kb(field):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

    def extra_peak_mb(fn):
        open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from what is resident
        before = rss_kb("VmRSS:")
        fn()
        return (rss_kb("VmHWM:") - before) / 1024

    out, numel = sys.argv[1], int(sys.argv[2])
    x = torch.randint(-128, 128, (numel,), dtype=torch.int8)
    with probe.mode("stats", out=out + "/warm") as s:  # compiles the kernels a piece takes
        x[: 1 << 16].abs(); s.step()
    result = {}

    def untraced():
        result["plain"] = x.abs()

    def traced():
        with probe.mode("stats", out=out + "/run") as s:
            result["traced"] = x.abs()
            s.step()

    plain_mb = extra_peak_mb(untraced)
    del result["plain"]
    traced_mb = extra_peak_mb(traced)
    y = result["traced"].to(torch.float64)
    print(json.dumps({"plain_mb": plain_mb, "traced_mb": traced_mb, "sum": float(y.sum())}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_an_int8_tensor_of_4_pieces_costs_a_piece_of_memory_under_stats(tmp_path):
    """A real size: 2^26 int8 elements (64 MiB). Before, the stats mode widened it whole to fp32
    for its compiled pass: 256 MiB more at peak than training without the probe."""
    numel = 4 * pieces.PIECE_NUMEL
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path), str(numel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    # A piece widened to fp32 is 64 MiB; the tensor widened whole was 256.
    assert measured["traced_mb"] - measured["plain_mb"] < 128, measured
    run = probe.load(tmp_path / "run")
    op = next(op for op in run.ops(step=0, rank=0) if op.name == "aten.abs.default")
    assert op.outputs[0].stats["mean"] * numel == pytest.approx(measured["sum"], rel=REL)


# -- warnings -------------------------------------------------------------------------------


@pytest.fixture
def warnings_as_errors():
    """pytest's ``filterwarnings = error``, or a program's ``warnings.simplefilter("error")``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _probe_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "probe"]


def test_a_filter_matching_nothing_is_logged_not_raised_from_step(tmp_path, warnings_as_errors, caplog):
    with probe.mode("stats", out=tmp_path / "run", ops=["no_such_op"]) as session:
        # session.step() used to raise the ProbeWarning
        train_steps(nn.Linear(8, 8), 2, session=session, optimizer="sgd")
    said = [m for m in _probe_log(caplog) if "selected none of the" in m]
    assert len(said) == 1 and "logged, not raised" in said[0], _probe_log(caplog)


def test_steps_never_reached_are_logged_not_raised_from_the_block_where_filters_make_errors(tmp_path, caplog):
    def run(name: str) -> None:
        errors._warned.clear()
        with probe.mode("stats", out=tmp_path / name, steps=[100]) as session:
            train_steps(nn.Linear(8, 8), 1, session=session, optimizer="sgd")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run("errors")  # leaving the block used to raise the ProbeWarning
    assert sum("steps= selected step(s) 100" in m for m in _probe_log(caplog)) == 1, _probe_log(caplog)
    caplog.clear()
    with warnings.catch_warnings():  # otherwise a warning, as always, and not logged as well
        warnings.simplefilter("always")
        with pytest.warns(ProbeWarning, match="steps= selected"):
            run("warns")
    with warnings.catch_warnings(record=True) as caught:  # an ignore filter is obeyed
        warnings.simplefilter("ignore")
        run("ignored")
    assert caught == [] and _probe_log(caplog) == []


_KERNELS_SCRIPT = textwrap.dedent("""
    import sys, warnings, torch, probe

    warnings.simplefilter("error")
    model = torch.nn.Linear(256, 256)
    with probe.mode("stats", out=sys.argv[1]) as session:
        for _ in range(2):
            model(torch.randn(256, 256)).sum().backward()  # the queued batches' standalone kernel
            torch.ones(1 << 16, dtype=torch.int8).neg()  # the torch.compile'd kernel
            session.step()
""")


def test_the_probe_compiles_its_own_kernels_under_warnings_as_errors(tmp_path):
    """torch warns while it compiles (a deprecation inside what inductor imports): under warnings
    as errors each of the probe's kernels failed to compile and it reduced eagerly from then on.
    A fresh process: kernels are compiled once per process."""
    done = subprocess.run([sys.executable, "-c", _KERNELS_SCRIPT, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unavailable" not in done.stderr, done.stderr[-3000:]
    assert probe.load(tmp_path / "run").steps == [0, 1]


def test_a_compiled_model_trains_under_stats_with_warnings_as_errors(tmp_path, warnings_as_errors):
    """torch warns at every call of a compiled module while global module hooks exist (the
    probe's module tracker): with warnings as errors that stopped training before step 0."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    compiled = torch.compile(model, backend="eager")
    filters = list(warnings.filters)
    with probe.mode("stats", out=tmp_path / "run") as session:
        train_steps(compiled, 2, session=session, optimizer="sgd")
    assert warnings.filters == filters  # the probe's filter for that warning left with its hooks
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]
    assert any(op.name == "aten.addmm.default" for op in run.ops(step=1, rank=0))
    # Outside the session torch's warning is the program's again.
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        with pytest.raises(UserWarning, match="global hooks on modules"):
            compiled(torch.randn(4, 8))
    finally:
        handle.remove()


def _train_mlp(session_factory: Callable[[nn.Module], probe.Session] | None
               ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Three steps of conftest's training loop on a small MLP, under ``session_factory(model)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    if session_factory is None:
        losses, _ = train_steps(model, 3, optimizer="sgd")
    else:
        with session_factory(model) as session:
            losses, _ = train_steps(model, 3, session=session, optimizer="sgd")
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_mode_whose_per_op_work_raises_is_detached_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A fault planted in the stats mode's per-op work (its ``after`` raising at the second
    addmm of step 1): training finishes bit-identical to a run without the probe, the mode is
    detached with one warning, the manifests of step 1 on say so, and the ops it no longer
    measured hold no statistics (never a value carried over)."""
    from probe.modes.stats.mode import StatsMode

    original = StatsMode.after
    seen = {"addmm": 0}

    def failing_after(self: StatsMode, call: object) -> None:
        if call.op_id.endswith("aten.addmm.default:0") and call.phase == "forward":  # type: ignore[attr-defined]
            seen["addmm"] += 1
            if seen["addmm"] == 4:  # step 1's second Linear
                raise ValueError("planted failure in the mode")
        original(self, call)

    monkeypatch.setattr(StatsMode, "after", failing_after)
    bare_losses, bare_state = _train_mlp(None)
    out = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, state = _train_mlp(lambda model: probe.mode("stats", out=str(out), model=model))
    assert all(torch.equal(a, b) for a, b in zip(losses, bare_losses, strict=True))
    for name, value in bare_state.items():
        assert torch.equal(state[name], value), name
    said = [str(w.message) for w in caught if "mode failed" in str(w.message)]
    assert len(said) == 1 and "planted failure" in said[0], said

    run = probe.load(str(out))
    manifests = {s: json.loads((out / "rank0" / f"step{s}" / "manifest.json").read_text()) for s in run.steps}
    assert "mode_failures" not in manifests[0]
    for step in (1, 2):
        reason = manifests[step]["mode_failures"]["stats"]
        assert reason.startswith("ValueError at forward:2[0]:aten.addmm.default:0"), reason
    failed_at = next(op for op in run.ops(step=1) if op.id == "forward:2[0]:aten.addmm.default:0")
    assert all(t.stats is None for t in failed_at.outputs)
    assert all(t.stats is None for op in run.ops(step=2) for t in op.outputs)
    measured = [t.stats for op in run.ops(step=0) for t in op.outputs if t.dtype.startswith("float")]
    assert measured and all(stats is not None for stats in measured)

    summary = subprocess.run([sys.executable, "-m", "probe.cli", "summary", str(out)],
                             capture_output=True, text=True, timeout=300)
    assert summary.returncode == 0, summary.stderr
    assert "MODE FAILED: stats (ValueError at forward:2[0]:aten.addmm.default:0" in summary.stdout
