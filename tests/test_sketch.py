"""Random-sign sketches (``probe.Stats(sketch=True)``): each recorded value's projections on fixed
sign vectors, whose difference between two runs estimates how far their elements are apart,
which statistics cannot (rounding in another order leaves the norm and the extremes as they were)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import probe
from probe.analysis import precision
from probe.modes.statistics import pieces
from probe.modes.statistics.sketch import BLOCK, SKETCHES, _signs, sketch
from probe.rundir.records import TensorRecord
from tests.conftest import SharedBlockNet, train_steps


def _by_definition(x: torch.Tensor) -> torch.Tensor:
    """The projections as the module docstring defines them, one element at a time."""
    flat = x.detach().reshape(-1).double()
    n = flat.numel()
    cpu = torch.device("cpu")
    columns = _signs.columns(cpu, torch.float64)
    blocks = _signs.blocks(-(-n // BLOCK), cpu, torch.float64)
    signs = torch.stack([blocks[i // BLOCK] * columns[i % BLOCK] for i in range(n)])
    return flat @ signs


@pytest.mark.parametrize("n", [1, 5, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_a_sketch_is_the_values_projected_on_the_sign_pattern(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(sketch(x), _by_definition(x))


def test_a_sketch_follows_the_logical_order_of_any_layout_and_of_pieces(monkeypatch):
    x = torch.randn(48, 100, generator=torch.Generator().manual_seed(1))
    transposed = x.t()  # not contiguous: its logical order is not its memory order
    expected = _by_definition(transposed)
    assert torch.allclose(sketch(transposed), expected, rtol=1e-12, atol=1e-9)
    monkeypatch.setattr(pieces, "PIECE_NUMEL", 2 * BLOCK)  # read in pieces: the same sums
    assert torch.allclose(sketch(transposed), expected, rtol=1e-12, atol=1e-9)
    z = torch.complex(x, -x)
    assert torch.allclose(sketch(z), _by_definition(torch.view_as_real(z)), rtol=1e-12, atol=1e-9)


def test_two_runs_sketches_estimate_how_far_their_elements_are_apart():
    # E[(s_j(a) - s_j(b))^2] = ||a - b||^2: over 200 tensors the mean of the squared estimate over
    # the squared distance is 1 within 4 standard deviations (chi-square of 8 over 8: sd 0.5 / sqrt(200)).
    generator = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(200):
        a = torch.randn(4096, generator=generator, dtype=torch.float64)
        b = a + 1e-6 * torch.randn(4096, generator=generator, dtype=torch.float64) * a.abs()
        ra, rb = (TensorRecord("float64", (4096,), {"norm": float(t.norm())},
                               sketch=tuple(sketch(t).tolist())) for t in (a, b))
        estimate = precision.sketch_error(ra, rb)
        assert estimate is not None
        ratios.append((estimate * max(float(a.norm()), float(b.norm())) / float((a - b).norm())) ** 2)
    assert abs(np.mean(ratios) - 1) < 4 * math.sqrt(2 / SKETCHES) / math.sqrt(len(ratios))
    # The norm sees little of the same differences: random signs cancel in it.
    assert abs(float(a.norm()) - float(b.norm())) / float(a.norm()) < estimate / 10


def test_a_sketch_without_its_pair_or_its_norm_estimates_nothing():
    a = TensorRecord("float32", (3,), {"norm": 1.0}, sketch=(1.0,) * SKETCHES)
    assert precision.sketch_error(a, TensorRecord("float32", (3,), {"norm": 1.0})) is None
    longer = TensorRecord("float32", (4,), {"norm": 1.0}, sketch=(1.0,) * SKETCHES)
    assert precision.sketch_error(a, longer) is None
    nonfinite = TensorRecord("float32", (3,), {"norm": math.inf}, sketch=(math.inf,) * SKETCHES)
    assert precision.sketch_error(a, nonfinite) is None
    assert precision.sketch_error(a, a) == 0.0


def test_training_under_sketches_is_bit_identical_and_every_float_value_has_one(tmp_path: Path):
    torch.manual_seed(0)
    plain = train_steps(SharedBlockNet(), 2, seed=1)
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    with probe.mode(probe.Stats(sketch=True), out=tmp_path / "r") as session:
        traced = train_steps(SharedBlockNet(), 2, session=session, seed=1)
    assert traced[0] == plain[0] and all(torch.equal(traced[1][k], plain[1][k]) for k in plain[1])
    assert torch.equal(torch.get_rng_state(), rng)  # the sign pattern draws from its own generator
    run = probe.load(tmp_path / "r")
    outputs = [t for op in run.ops(1) for t in op.outputs if t.stats is not None]
    floating = [t for t in outputs if t.dtype.startswith("float")]
    assert floating and all(t.sketch is not None and len(t.sketch) == SKETCHES for t in floating)
    assert all(t.sketch is None for t in outputs if not t.dtype.startswith(("float", "complex")))
    assert run.step_info(1).manifest["modes"]["stats"]["sketch"] is True


def test_a_run_without_sketches_reads_as_before(tmp_path: Path):
    with probe.mode("stats", out=tmp_path / "r") as session:
        torch.ones(4).mul(2.0)
        session.step()
    run = probe.load(tmp_path / "r")
    assert all(t.sketch is None for op in run.ops(0) for t in op.outputs)


def test_a_tensor_above_2_20_elements_with_grad_is_sketched_in_pieces_as_defined(tmp_path: Path, monkeypatch):
    # 2049 x 1029 (2.1M elements, not a multiple of the block), a leaf that requires grad, read in
    # pieces of 2^20: the same projections as the definition (vectorised here), and a training
    # step over it records a sketch of its gradient.
    monkeypatch.setattr(pieces, "PIECE_NUMEL", 1 << 20)
    w = torch.randn(2049, 1029, generator=torch.Generator().manual_seed(3), requires_grad=True)
    n = w.numel()
    cpu = torch.device("cpu")
    blocks = _signs.blocks(-(-n // BLOCK), cpu, torch.float64).repeat_interleave(BLOCK)[:n]
    columns = _signs.columns(cpu, torch.float64).repeat(-(-n // BLOCK), 1)[:n]
    expected = (w.detach().reshape(-1).double() * blocks) @ columns
    assert torch.allclose(sketch(w), expected, rtol=1e-12, atol=1e-9)
    with probe.mode(probe.Stats(sketch=True), out=tmp_path / "r") as session:
        (w * 2.0).sum().backward()
        session.step()
    backward = {op.name: t for op in probe.load(tmp_path / "r").ops(0) for t in op.outputs
                if t.shape == (2049, 1029) and op.phase == "backward"}
    assert backward["aten.mul.Tensor"].sketch is not None  # the weight's gradient, 2 everywhere
    assert backward["aten.expand.default"].sketch is None  # sum's gradient: a broadcast view


def _sketch_table(root: Path, step: int) -> np.ndarray:
    return np.load(root / "rank0" / f"step{step}" / "sketch.npy")


def _in_order(x: torch.Tensor, positions: list[int] | None) -> torch.Tensor:
    """``x``'s values flat in the order ``positions`` (its dims' strides in it) gives."""
    if positions is None:
        return x.reshape(-1)
    at = sum(torch.arange(size).view(*[-1 if d == dim else 1 for d in range(x.dim())]) * step
             for dim, (size, step) in enumerate(zip(x.shape, positions, strict=True)))
    return torch.empty(x.numel(), dtype=x.dtype).index_put_((at.reshape(-1),), x.reshape(-1))


def test_where_the_kernel_runs_queued_values_are_sketched_in_the_same_read_as_their_statistics(
        tmp_path: Path, monkeypatch):
    # The accelerator path (CUDA with Triton; the kernel itself is checked under Triton's
    # interpreter, tests/multi_tensor_checks.py) taken for the CPU with a stand-in kernel that
    # makes each row and sketch as the eager forms do: the values the engine queues (above 2^15
    # elements: a 256 x 512 weight, its gradient, the activations) get their sketches in the call
    # that reduces their batch, several tensors a call, and no other sketch call is made for them;
    # every row gets the projections it gets at capture, bit for bit; training is untouched.
    from probe.modes.statistics import capture, reduce
    from probe.modes.statistics import sketch as sketch_module
    from probe.modes.statistics.columns import raw_row

    calls, reordered = [], []

    def stand_in(xs, threshold, signs=None):
        calls.append((len(xs), signs is not None))
        rows = [raw_row(x.reshape(-1).double(), threshold) for x in xs]
        if signs is None:
            return torch.stack(rows)
        columns, blocks, positions = signs
        assert columns.dtype == torch.int8 and blocks.numel() >= -(-max(x.numel() for x in xs) // BLOCK)
        positions = positions or [None] * len(xs)
        reordered.extend(order is not None for order in positions)
        return torch.stack([torch.cat([row, sketch_module.eager_sketch(_in_order(x, order))])
                            for row, x, order in zip(rows, xs, positions, strict=True)])

    class Heads(torch.nn.Module):
        # An attention's layouts: heads transposed to the front (a permuted result the engine
        # queues in storage order) and rotate_half's strided halves.
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            heads = y.view(256, 8, 64).transpose(0, 1) * 1.5
            turned = torch.cat([-heads[..., 32:], heads[..., :32]], -1)
            return (heads + turned).transpose(0, 1).reshape(256, 512)

    def train(root: Path) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), Heads(), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256))
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
        losses = []
        with probe.mode(probe.Stats(sketch=True), out=root) as session:
            for _ in range(2):
                loss = model(x).square().mean()
                loss.backward()
                adamw.step()
                adamw.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                session.step()
        return [*losses, *(p.detach() for p in model.parameters())]

    plain = train(tmp_path / "capture")
    monkeypatch.setattr(reduce, "MULTI_TENSOR_DEVICES", ("cpu",))
    monkeypatch.setattr(capture.StepRows, "_on_host", staticmethod(lambda device: False))
    eager, eager_sketch = [], sketch_module.eager_sketch
    monkeypatch.setattr(sketch_module, "eager_sketch", lambda x: eager.append(1) or eager_sketch(x))
    with reduce.multi_tensor_kernel_replaced(stand_in):
        routed = train(tmp_path / "batched")
        kept = reduce.multi_tensor_kernel(torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(routed, plain, strict=True))
    fused = [n for n, with_signs in calls if with_signs and n > 1]
    assert fused, calls  # batches of several tensors, their sketches in the same call
    assert kept is stand_in  # never failed: not turned off
    assert any(reordered), "no permuted value sketched in its logical order by the kernel"
    for step in (0, 1):
        a, b = _sketch_table(tmp_path / "capture", step), _sketch_table(tmp_path / "batched", step)
        assert a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b))
        assert np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)])
        assert (~np.isnan(a[:, 0])).sum() > 10
    # Every sketch came from a kernel call (the stand-in's eager form), none from the eager path.
    assert len(eager) == sum(n for n, with_signs in calls if with_signs)


def _permuted_weight_run(out: Path, permute: bool, sketch: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 1))
    if permute:  # the same values in other places: every statistic of the weight as it was
        with torch.no_grad():
            w = model[0].weight
            order = torch.randperm(w.numel(), generator=torch.Generator().manual_seed(1))
            w.copy_(w.flatten()[order].view_as(w))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    with probe.mode("stats", out=str(out), model=model, sketch=sketch, checksums=False) as session:
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            session.step()


@pytest.mark.parametrize("sketch", [False, True])
def test_a_weight_whose_elements_moved_is_found_by_its_sketches_and_without_them_the_report_says_so(
        sketch: bool, tmp_path: Path):
    # A weight permuted in run B: its min, max, mean and norm are run A's, bit for bit. Without
    # sketches compare sees its reader's result differ from inputs that agree ('propagation') and
    # says what to record; with them, the weight itself differs at step 0 ('outside input').
    _permuted_weight_run(tmp_path / "a", False, sketch)
    _permuted_weight_run(tmp_path / "b", True, sketch)
    divergence = probe.compare(tmp_path / "a", tmp_path / "b").divergence
    assert divergence is not None and divergence.step == 0 and divergence.op.module == "0"
    message = divergence.comparison.message
    if sketch:
        assert divergence.rule == "outside input", message
        assert "its elements differ (its sketches), its statistics do not" in message
    else:
        assert divergence.rule == "propagation", message
        assert "record both runs with sketch=True" in message


def test_records_alike_in_the_exact_regime_compare_their_sketches_non_finite_ones_included():
    from probe.analysis.judging.carried_state import _stats_alike

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    moved = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    masked = x.clone()
    masked[::7] = -math.inf

    def record(t: torch.Tensor) -> TensorRecord:
        finite = t[t.isfinite()].double()
        stats = {"min": float(t.min()), "max": float(t.max()), "mean": float(t.double().mean()),
                 "norm": float(finite.norm()), "nan": 0, "inf": int(t.isinf().sum())}
        return TensorRecord("float32", tuple(t.shape), stats, sketch=tuple(sketch(t).tolist()))

    assert _stats_alike(record(x), record(x.clone()))
    assert not _stats_alike(record(x), record(moved))  # every statistic alike, the elements not
    assert _stats_alike(record(x), record(moved), sketches=False)
    assert _stats_alike(record(masked), record(masked.clone()))  # -inf projections, alike in both
