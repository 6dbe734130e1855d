"""The free benchmark's batched deviations: many pairs per device reduction, the same numbers as
one pair at a time, measured before later in-place writes; improve_precision's fused nudge."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import probe
from probe.modes.free_benchmark.deviation import DeviationQueue, deviation
from probe.modes.free_benchmark.perturbations import _one_ulp_moved, one_ulp_moved


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for n, dtype in ((7, torch.float32), (1000, torch.bfloat16), (5000, torch.float16), (300, torch.float64)):
        o = torch.randn(n, generator=gen).to(dtype)
        p = o.double() * (1 + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64))
        pairs.append((o, p, None))
    zero = torch.zeros(4, 8)
    floor = torch.tensor(1e-3, dtype=torch.float64)
    pairs.append((zero, zero + 1e-4, floor))   # all-zero output, change below the floor: ratio 0
    pairs.append((zero, zero + 1e-2, floor))   # above it: change / floor
    special = torch.tensor([1.0, float("nan"), float("inf"), -2.0, 3.0])
    pairs.append((special, torch.tensor([1.0, 2.0, float("inf"), 2.0, float("nan")]), None))
    wide = torch.randn(64, 32, generator=gen)
    pairs.append((wide.t(), wide.t() + 1e-6, None))  # a non-contiguous output
    return pairs


@pytest.mark.parametrize("capacity", [1 << 21, 1200, 10])
def test_batched_deviations_equal_one_pair_at_a_time(capacity):
    pairs = _pairs()
    queue = DeviationQueue(capacity)
    rows = [queue.add(o, p, o.dtype, floor) for o, p, floor in pairs]
    assert rows == list(range(len(pairs)))
    batched = queue.values()
    single = np.stack([deviation(o, p, torch.finfo(o.dtype).tiny, floor).numpy() for o, p, floor in pairs])
    np.testing.assert_allclose(batched[:, 0], single[:, 0], rtol=1e-12)  # rms summed in another order
    np.testing.assert_array_equal(batched[:, 1:], single[:, 1:])
    assert batched[4, 0] == 0 and batched[5, 0] == pytest.approx(10)
    assert batched[6, 1] == 2 and batched[6, 2] == 1  # NaN appeared and vanished; -2 -> 2 flipped
    if capacity == 1 << 21:
        assert queue.reductions == 1  # every pair in one device reduction
    elif capacity == 10:
        assert queue.reductions >= len(pairs) - 2  # pairs over the capacity are reduced alone


def test_a_queued_pair_is_measured_as_it_was_when_queued():
    queue = DeviationQueue()
    o = torch.ones(16)
    p = o + 1e-6
    queue.add(o, p, o.dtype, None)
    o.zero_()  # training writes the output in place before the step's reduction
    p.mul_(100)
    (ratio, mismatch, flips), = queue.values()
    assert ratio == pytest.approx(1e-6, rel=0.1) and mismatch == 0 and flips == 0


def test_an_output_written_in_place_by_the_next_op_is_judged_as_the_op_produced_it(tmp_path):
    x = torch.linspace(0.5, 2.0, 256)
    with probe.mode("free_benchmark", out=tmp_path / "r", perturb="add_noise") as session:
        y = x.exp()
        y.zero_()  # a later in-place write; the exp check must not see it
        session.step()
    (check,) = [c for c in probe.load(tmp_path / "r").checks() if c.name == "aten.exp.default"]
    assert check.verdict == "pass" and 0 < check.ratio < 1e-5


@pytest.mark.parametrize("numel", [300, 1 << 16])  # eager, and the compiled fused pass
@pytest.mark.parametrize(("low", "high"), [(torch.float32, torch.float64), (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float32)])
def test_the_nudged_upcast_equals_nudging_then_upcasting(numel, low, high):
    x = (torch.randn(numel // 100, 100, generator=torch.Generator().manual_seed(0)) * 100).to(low)
    flat = x.view(-1)
    flat[0], flat[1], flat[2] = float("inf"), float("nan"), torch.finfo(low).max
    flat[3] = torch.finfo(low).tiny / 2  # subnormal: not moved
    for t in (x, x.t()):
        fused = one_ulp_moved(t, high)
        assert fused.dtype == high and fused.shape == t.shape
        assert torch.equal(fused.nan_to_num(), _one_ulp_moved(t).to(high).nan_to_num())


def test_a_pair_worth_its_own_pass_is_reduced_at_once_and_small_ones_wait():
    queue = DeviationQueue()
    small, large = torch.ones(100), torch.ones(1 << 16)  # on a CPU, 32K elements are worth a pass
    queue.add(small, small * 2, torch.float32, None)
    assert queue.reductions == 0  # staged
    queue.add(large, large * 2, torch.float32, None)
    assert queue.reductions == 1  # reduced at once, without the copies
    np.testing.assert_array_equal(queue.values(), [[1, 0, 0], [1, 0, 0]])  # |2 - 1| / 1
    assert queue.reductions == 2
