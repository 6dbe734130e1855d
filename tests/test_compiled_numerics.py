"""torch.compile'd runs judged as they run (issue 24), on a real model: a Qwen2 (tiny config,
random weights, fp32, AdamW, 2 steps) whose run B is compiled and carries a bug only on the
compiled path: layer 1's post-attention RMSNorm computes in bf16 when
``torch.compiler.is_compiling()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import probe
from probe.cli import main as cli_main
from tests.hf_models import tiny_qwen2, train_steps

NOT_OBSERVED = ("run B's compiled code ran eagerly under the probe: the numerics of compiled code "
                "were not observed; record with compiled='keep'")


def bf16_when_compiling(norm: torch.nn.Module) -> None:
    """Make ``norm`` (a Qwen2RMSNorm) compute in bf16 when traced by dynamo, as it is eagerly
    otherwise: a bug only the compiled code has."""
    base = type(norm)

    class Bf16WhenCompiling(base):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            if not torch.compiler.is_compiling():
                return super().forward(hidden_states)
            h = hidden_states.to(torch.bfloat16)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return self.weight * h.to(hidden_states.dtype)

    norm.__class__ = Bf16WhenCompiling


def buggy_qwen2() -> torch.nn.Module:
    model = tiny_qwen2()
    bf16_when_compiling(model.model.layers[1].post_attention_layernorm)
    return model


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run A: the model trained eagerly, the reference."""
    out = tmp_path_factory.mktemp("compiled") / "a"
    model = tiny_qwen2()
    with probe.mode("stats", out=out, model=model) as session:
        train_steps(model, session, steps=3)
    return out


# torch warns that global module hooks (the probe's) fire once more for the OptimizedModule.
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
@pytest.mark.filterwarnings("ignore:probe. compiled regions run eagerly")
def test_default_eager_says_compiled_code_was_not_observed(tmp_path: Path, eager_run: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    torch._dynamo.reset()
    model = buggy_qwen2()
    compiled = torch.compile(model)
    with probe.mode("stats", out=tmp_path / "b", model=model) as session:
        train_steps(compiled, session)
    run_b = probe.load(tmp_path / "b")
    for step in run_b.steps:
        # Each forward entered the compiled model and ran it eagerly.
        assert run_b.step_info(step).manifest["compiled_ran_eagerly"] >= 1
    report = probe.compare(eager_run, tmp_path / "b")
    # The bug is not seen (the eager path has none), and the conclusion says why it could not be.
    assert report.divergence is None
    assert report.conclusion.endswith("; " + NOT_OBSERVED), report.conclusion
    assert NOT_OBSERVED in report.summary["conclusion"]
    # The reference itself ran no compiled code: nothing to say about it.
    assert "run A" not in probe.compare(eager_run, eager_run).conclusion
    assert cli_main(["summary", str(tmp_path / "b")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("this run's compiled code ran eagerly under the probe: the numerics of compiled code were "
            "not observed") in out
    assert cli_main(["summary", str(eager_run)]) == 0
    assert "compiled code" not in capsys.readouterr().out


def _compiled_keep_run(out: Path, model: torch.nn.Module, steps: int) -> list[torch.Tensor]:
    torch._dynamo.reset()
    compiled = torch.compile(model)
    with probe.mode("stats", out=out, model=model, compiled="keep") as session:
        return train_steps(compiled, session, steps=steps)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_keep_names_the_module_inside_the_compiled_region(tmp_path: Path, eager_run: Path) -> None:
    model = buggy_qwen2()
    _compiled_keep_run(tmp_path / "b", model, steps=2)
    run_b = probe.load(tmp_path / "b")
    ops = run_b.ops(0)
    regions = [op for op in ops if op.name.startswith("compiled.")]
    assert [op.phase for op in regions] == ["forward", "backward"]
    opened = run_b.step_info(0).manifest["compiled_regions_opened"]
    assert sorted(opened) == sorted(op.id for op in regions)
    # The region's graph, re-run node by node, shows the bf16 only the compiled path has, in its module.
    norm = [op for op in ops
            if op.module == "model.layers.1.post_attention_layernorm" and op.phase == "forward"]
    assert any(op.name == "prims.convert_element_type.default" and op.outputs[0].dtype == "bfloat16"
               for op in norm)
    assert {op.module for op in ops if op.name == "aten.mm.default"} >= {
        "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj", "lm_head"}
    report = probe.compare(eager_run, tmp_path / "b")
    d = report.divergence
    assert d is not None and d.step == 0
    assert d.op.module == "model.layers.1.post_attention_layernorm", report.conclusion
    assert "compiled" not in d.op.name and "ran eagerly" not in report.conclusion


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_healthy_compiled_run_against_its_eager_twin_has_no_divergence(tmp_path: Path,
                                                                       eager_run: Path) -> None:
    _compiled_keep_run(tmp_path / "b", tiny_qwen2(), steps=3)
    report = probe.compare(eager_run, tmp_path / "b")
    assert report.divergence is None, report.conclusion
    assert report.conclusion.startswith("no divergence"), report.conclusion
    assert report.counts["pass"] > 100 and sorted({s.step for s in report.steps}) == [0, 1, 2]


def _conv_bn(out: Path, compiled: bool) -> None:
    """A convolution with a bias before BatchNorm, 2 AdamW steps; compiled: traced with 'keep'."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    runner = torch.compile(model) if compiled else model
    with probe.mode("stats", out=out, model=model, **({"compiled": "keep"} if compiled else {})) as session:
        for _ in range(2):
            x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 4, (4,), generator=gen)
            torch.nn.functional.cross_entropy(runner(x), y).backward()
            opt.step()
            opt.zero_grad()
            session.step()


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_a_compiled_region_is_bounded_by_the_rounding_of_the_eager_ops_it_replaced(tmp_path: Path) -> None:
    """The compiled forward and backward are two opaque ops; the gradients they leave are judged by
    the eager run's chain of the ops they replaced: its sums over the batch and positions, and the
    conv bias's gradient before BatchNorm, zero in exact arithmetic (each run's is rounding)."""
    _conv_bn(tmp_path / "a", compiled=False)
    _conv_bn(tmp_path / "b", compiled=True)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
