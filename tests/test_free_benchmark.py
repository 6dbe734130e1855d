"""Free-benchmark mode: transparent checks, few false alarms, fragile ops found, fixes."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections import Counter

import pytest
import torch

import probe
from probe import ProbeError
from probe.demo.model import TinyLlama, synthetic_batch
from probe.modes.free_benchmark import mode as fb
from probe.modes.free_benchmark.perturbations import PERTURBATIONS
from tests.conftest import SharedBlockNet, train_steps, train_under


@torch.library.custom_op("probetest::sloppy_square", mutates_args=())
def sloppy_square(x: torch.Tensor) -> torch.Tensor:
    """A kernel whose low-precision path is wrong by 3% (as a fused device kernel might be)."""
    y = x * x
    return y * 1.03 if x.dtype in (torch.float16, torch.bfloat16) else y


@sloppy_square.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.mark.parametrize("perturb", PERTURBATIONS)
def test_check_mode_is_bitwise_transparent(tmp_path, perturb):
    plain = train_under(lambda m: None, seed=3)
    checked = train_under(
        lambda m: probe.mode("free_benchmark", out=tmp_path / "r", model=m, perturb=perturb), seed=3
    )
    assert all(torch.equal(a, b) for a, b in zip(plain[0], checked[0], strict=True))
    for name in plain[1]:
        assert torch.equal(plain[1][name], checked[1][name]), name
        assert torch.equal(plain[2][name], checked[2][name]), name
    assert torch.equal(plain[3], checked[3])
    verdicts = Counter(c.verdict for c in probe.load(tmp_path / "r").checks())
    assert verdicts["pass"] > 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("perturb", ["add_noise", "bit_noise", "improve_precision"])
def test_a_healthy_low_precision_model_has_at_most_one_percent_flagged(tmp_path, dtype, perturb):
    torch.manual_seed(0)
    model = TinyLlama().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    with probe.mode("free_benchmark", out=tmp_path / "r", model=model, perturb=perturb) as session:
        for _ in range(2):
            model.loss(synthetic_batch(model.config, 4, 32, data)).backward()
            opt.step()
            opt.zero_grad()
            session.step()
    checks = probe.load(tmp_path / "r").checks()
    counts = Counter(c.verdict for c in checks)
    judged = counts["pass"] + counts["fail"]
    assert judged > 500 and {c.phase for c in checks} >= {"forward", "backward", "optimizer"}
    assert counts["fail"] <= 0.01 * judged, [c.op_id for c in checks if c.verdict == "fail"][:10]


def test_a_cancellation_is_flagged_in_forward_and_in_backward(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(64, generator=gen) + 0.5).half().requires_grad_()
    w = (1000 + 0.1 * torch.randn(64, generator=gen)).half()
    with probe.mode("free_benchmark", out=tmp_path / "r", perturb="add_noise"):
        shifted = (x + 1000) - 1000                       # forward: cancellation of nearly equal values
        loss = ((shifted - shifted.mean()) * w).sum()     # backward: w - mean(w), nearly equal values
        loss.backward()
    failed = [c for c in probe.load(tmp_path / "r").checks() if c.verdict == "fail"]
    forward = [c for c in failed if c.phase == "forward"]
    backward = [c for c in failed if c.phase == "backward"]
    # fp16 1000 + x keeps x to 0.25: about 2 of its 11 bits, the ratio 4x the 4-bit bound
    assert forward and forward[0].name == "aten.sub.Tensor" and forward[0].ratio > 3 * forward[0].threshold
    assert backward and {c.name for c in backward} & {"aten.sub.Tensor", "aten.add.Tensor"}


def test_inplace_ops_rerun_on_copies(tmp_path):
    x = torch.arange(6, dtype=torch.float32)
    before = x._version
    with probe.mode("free_benchmark", out=tmp_path / "r", perturb="add_noise"):
        x.add_(1)
    assert torch.equal(x, torch.arange(6, dtype=torch.float32) + 1)
    assert x._version == before + 1
    (check,) = probe.load(tmp_path / "r").checks()
    assert check.name == "aten.add_.Tensor" and check.verdict == "pass"


def test_foreach_optimizer_ops_rerun_on_copies_of_their_tensor_lists(tmp_path):
    # AdamW's default on accelerators: _foreach_*_ ops write whole tensor lists.
    # A re-run on the already-updated lists would apply each update twice.
    from probe.demo.train import DemoTraining, train

    plain = train(DemoTraining(foreach=True), 2)
    training = DemoTraining(foreach=True)
    session = probe.mode("free_benchmark", out=tmp_path / "r", model=training.model, perturb="no_change",
                         phases=["optimizer"])
    assert train(training, 2, session=session) == plain
    checks = probe.load(tmp_path / "r").checks(1)
    foreach = [c for c in checks if c.name.startswith("aten._foreach_")]
    assert len(foreach) > 20
    assert [c for c in foreach if c.verdict != "pass"] == []


_SOLVES = {
    "linalg.solve": lambda a, b: torch.linalg.solve(a, b),
    "linalg.solve_ex": lambda a, b: torch.linalg.solve_ex(a, b).result,
    "linalg.solve_triangular": lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
    "triangular_solve": lambda a, b: torch.triangular_solve(b, a).solution,
}


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
@pytest.mark.parametrize("op", list(_SOLVES))
def test_gradients_keep_the_layout_autograd_gives_them(tmp_path, op):
    # The solves compute column-major: the (3, 1) right-hand side's gradient has strides (1, 3).
    # AccumulateGrad keeps a gradient as computed when nothing else holds it, and copies it into
    # the leaf's layout, (1, 1), otherwise: a mode that holds an op's tensors past the op changes
    # .grad's strides. The cyclic collector is off, as it may be at any moment of training.
    gen = torch.Generator().manual_seed(0)
    a0 = torch.randn(3, 3, generator=gen).triu() + 3 * torch.eye(3)
    b0 = torch.randn(3, 1, generator=gen)
    runs = []
    for session in (contextlib.nullcontext(), probe.mode("free_benchmark", out=tmp_path / "r")):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        gc.disable()
        try:
            with session:
                x = _SOLVES[op](a, b)
                x.backward(torch.ones_like(x))
        finally:
            gc.enable()
        runs.append((x.detach(), a.grad, b.grad))
    bare, probed = runs
    assert bare[2].stride() == (1, 3)  # the layout a reference held too long would lose
    def layouts(tensors: tuple[torch.Tensor, ...]) -> list[tuple[tuple[int, ...], int]]:
        return [(t.stride(), t.storage_offset()) for t in tensors]

    assert layouts(probed) == layouts(bare)
    assert all(torch.equal(p, q) for p, q in zip(probed, bare, strict=True))
    checked = {c.phase for c in probe.load(tmp_path / "r").checks() if c.verdict != "skip"}
    assert checked == {"forward", "backward"}


@pytest.mark.parametrize("perturb", PERTURBATIONS)
def test_a_checked_ops_tensors_are_freed_by_reference_counting(tmp_path, perturb):
    # Whatever the re-run holds (inputs, their copies, results) must go when the op returns,
    # not when Python's cyclic collector runs: see the test above for what a late one changes.
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with probe.mode("free_benchmark", out=tmp_path / "r", perturb=perturb):
        gc.disable()
        try:
            x = a.clone()
            y = torch.mm(x, b)
            x.add_(y)  # a written argument: the re-run works on a snapshot of it
            refs = [weakref.ref(x), weakref.ref(y)]
            del x, y
            alive = [r() is not None for r in refs]
        finally:
            gc.enable()
    assert alive == [False, False]
    checks = probe.load(tmp_path / "r").checks()
    assert {c.name for c in checks if c.verdict != "skip"} == {"aten.mm.default", "aten.add_.Tensor"}


def test_fix_replaces_a_sloppy_low_precision_kernel_with_its_higher_precision_result(tmp_path):
    x = torch.linspace(0.5, 2.0, 32).half()
    plain = torch.ops.probetest.sloppy_square(x)
    with probe.mode("free_benchmark", out=tmp_path / "c", perturb="improve_precision"):
        checked = torch.ops.probetest.sloppy_square(x)
    with probe.mode("free_benchmark", out=tmp_path / "f", perturb="improve_precision", handler="fix"):
        fixed = torch.ops.probetest.sloppy_square(x)
    assert torch.equal(checked, plain)  # check mode changes nothing
    (check,) = probe.load(tmp_path / "c").checks()
    assert check.name == "probetest.sloppy_square.default" and check.verdict == "fail"
    exact = (x.double() ** 2).half()
    assert fixed.dtype == torch.float16 and fixed.shape == x.shape
    assert (fixed.double() - exact.double()).abs().max() <= 1e-3 * exact.double().abs().max()
    assert (plain.double() - exact.double()).abs().max() > 1e-2 * exact.double().abs().max()


def test_to_cpu_uses_a_registered_reference_for_custom_ops(tmp_path):
    x = torch.linspace(0.5, 2.0, 32)
    probe.register_cpu_reference("probetest::sloppy_square", lambda t: t * t)
    with probe.mode("free_benchmark", out=tmp_path / "r", perturb="to_cpu", handler="fix"):
        y = torch.ops.probetest.sloppy_square(x.half())
    (check,) = probe.load(tmp_path / "r").checks()
    assert check.verdict == "fail" and check.perturb == "to_cpu"
    assert torch.allclose(y.float(), x * x, rtol=2e-3)


def test_running_out_of_memory_skips_the_check_not_training(tmp_path, monkeypatch):
    def no_memory(self, call, snapshot):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(fb.FreeBenchmarkMode, "_rerun", no_memory)
    with probe.mode("free_benchmark", out=tmp_path / "r"):
        y = torch.ones(4).exp()
    assert torch.equal(y, torch.ones(4).exp())
    (check,) = probe.load(tmp_path / "r").checks()
    assert check.verdict == "skip" and "out of memory" in check.reason


def test_preheat_measures_then_adapts_thresholds(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("free_benchmark", out=tmp_path / "r", model=model, perturb="add_noise",
                    preheat=True, preheat_steps=1, max_sample=2) as session:
        train_steps(model, 2, session=session)
    run = probe.load(tmp_path / "r")
    first, second = run.checks(0), run.checks(1)
    assert first and all(c.verdict == "skip" and c.reason == "preheat" for c in first)
    per_op = Counter(c.name for c in first)
    assert max(per_op.values()) <= 2 * 2  # max_sample calls, each with up to two outputs
    observed = {}
    for c in first:
        observed[c.name] = max(observed.get(c.name, 0.0), c.ratio)
    assert all(c.threshold >= 2 * observed.get(c.name, 0.0) for c in second if c.verdict != "skip")
    assert any(c.verdict == "pass" for c in second)


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ProbeError, match="'perturb': 'noise' is not one of"):
        probe.mode("free_benchmark", out=tmp_path / "a", perturb="noise")
    with pytest.raises(ProbeError, match="'fix' needs perturb"):
        probe.mode("free_benchmark", out=tmp_path / "b", perturb="add_noise", handler="fix")
    with pytest.raises(ProbeError, match="max_checks_per_op"):
        probe.mode("free_benchmark", out=tmp_path / "c", max_checks_per_op=0)


def test_max_checks_per_op_caps_the_checks(tmp_path):
    with probe.mode("free_benchmark", out=tmp_path / "r", max_checks_per_op=2) as session:
        x = torch.ones(8)
        for _ in range(5):
            x = x.exp().log()
        session.step()
    names = Counter(c.name for c in probe.load(tmp_path / "r").checks())
    assert names == {"aten.exp.default": 2, "aten.log.default": 2}




def test_contractions_get_a_rounding_allowance_that_grows_with_their_length():
    from probe.modes.free_benchmark.perturbations import reduction_length, threshold

    a, b, bias = torch.ones(3, 1600), torch.ones(1600, 5), torch.ones(5)
    assert reduction_length("aten.mm.default", (a, b)) == 1600
    assert reduction_length("aten.addmm.default", (bias, a, b)) == 1600
    assert reduction_length("aten.add.Tensor", (a, a)) == 1
    # fp32: 4 ULPs are below the 1e-5 floor; 4 sqrt(1600) ULPs (40x more) are above it.
    assert threshold(0.0, torch.float32) == threshold(0.0, torch.float32, 1) == 1e-5
    assert threshold(0.0, torch.float32, 1600) == pytest.approx(160 * torch.finfo(torch.float32).eps)
