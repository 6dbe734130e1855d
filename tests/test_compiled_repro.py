"""Eager vs compiled judged per compiled region, and ``probe repro`` (issue 24 items 3 and 4), on a
small MLP whose compiled code carries a wrong Inductor lowering: gelu without its 0.5, registered
for Inductor only (the graph, and so the eager re-run, keeps the right ``aten.gelu``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import probe
from probe.analysis.compiled_judge import run_verdicts
from probe.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
# The compiled model's own module call holds its region, as its eager twin's ops (its hooks ran
# compiled by dynamo, doing nothing, before the probe's frames were kept out of dynamo: the
# region sat in the OptimizedModule wrapper's call).
REGION = "forward:[0]:compiled.Mlp.forward:0"


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


@contextmanager
def gelu_without_half() -> Iterator[None]:
    """Inductor lowers ``aten.gelu`` as ``x * (1 + erf(x / sqrt 2))``: the 0.5 forgotten. Its
    decomposition is taken out of Inductor's table so the graph keeps ``aten.gelu`` (eager right)."""
    from torch._inductor import decomposition, lowering

    aten = torch.ops.aten
    tables = [decomposition.decompositions, decomposition.fast_random_decomps()]
    saved = [table.pop(aten.gelu.default, None) for table in tables]
    lowered = lowering.lowerings.get(aten.gelu.default)

    def wrong_gelu(x: object, approximate: str = "none") -> object:
        low = lowering.lowerings
        erf = low[aten.erf.default](low[aten.mul.Tensor](x, 0.7071067811865476))
        return low[aten.mul.Tensor](x, low[aten.add.Tensor](erf, 1.0))

    lowering.lowerings[aten.gelu.default] = wrong_gelu
    try:
        yield
    finally:
        for table, entry in zip(tables, saved, strict=True):
            if entry is not None:
                table[aten.gelu.default] = entry
        if lowered is None:
            lowering.lowerings.pop(aten.gelu.default, None)
        else:
            lowering.lowerings[aten.gelu.default] = lowered


def record(out: Path, steps: int = 2) -> None:
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = Mlp()
    torch._dynamo.reset()
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with inductor_config.patch(fx_graph_cache=False), \
            probe.mode("stats", out=out, model=model, compiled="keep", compiled_inputs=True) as session:
        for _ in range(steps):
            compiled(torch.randn(4, 16)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step()


@pytest.fixture(scope="module")
def buggy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repro") / "b"
    with gelu_without_half():
        record(out)
    return out


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_region_graph_and_inputs_are_written_and_judged(buggy_run: Path) -> None:
    rank = buggy_run / "rank0"
    run = probe.load(buggy_run)
    files = run.step_info(0).manifest["compiled_region_files"]
    assert sorted(files) == sorted(run.step_info(0).manifest["compiled_regions_opened"])
    graph = json.loads((rank / "compiled" / f"{files[REGION]['graph']}.json").read_text())
    gelu = [n for n in graph["nodes"] if n.get("target") == "aten.gelu.default"]
    assert len(gelu) == 1 and gelu[0]["module"] == "act"
    assert "torch.ops.aten.gelu.default" in (rank / "compiled" / f"{files[REGION]['graph']}.py").read_text()
    assert (rank / files[REGION]["tensors"]).stat().st_size > 16 * 4 * 4
    verdicts = {(v.op_id, v.step): v for v in run_verdicts(run)}
    forward = verdicts[(REGION, 0)]
    d = forward.divergence
    # The earliest compiled output further from fp64 than eager: gelu's, in the module it came from.
    assert d is not None and d.node == gelu[0]["name"] and d.module == "act"
    assert d.compiled_error > 0.1 > 1e-5 > d.eager_error
    conclusion = probe.compare(buggy_run, buggy_run).conclusion
    assert (f"run B's compiled region {REGION} (step 0) differs from its graph run eagerly beyond "
            f"rounding at node {d.node} in act") in conclusion, conclusion


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_healthy_compiled_regions_are_consistent_with_rounding(tmp_path: Path) -> None:
    record(tmp_path / "ok", steps=3)
    verdicts = run_verdicts(probe.load(tmp_path / "ok"))
    assert len(verdicts) == 6 and all(v.skipped is None and v.judgements for v in verdicts)
    assert all(v.divergence is None and v.eager_worse is None for v in verdicts)
    conclusion = probe.compare(tmp_path / "ok", tmp_path / "ok").conclusion
    assert conclusion.endswith("consistent with compiled code's rounding"), conclusion


def _run_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    inject = ("import runpy, sys; from tests.test_compiled_repro import gelu_without_half\n"
              f"sys.argv = [{str(script)!r}, *{list(args)!r}]\n"
              f"with gelu_without_half(): runpy.run_path({str(script)!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", inject], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)`:UserWarning")
def test_repro_is_at_most_five_nodes_and_fails_compiled_passes_eager(
        buggy_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "repro_gelu.py"
    with gelu_without_half():
        assert cli_main(["repro", str(buggy_run), REGION, "-o", str(script)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    nodes = int(out.split(" graph node(s)")[0].rsplit("(", 1)[1])
    assert 1 <= nodes <= 5, out
    assert "aten.gelu.default" in script.read_text()
    assert script.with_suffix(".safetensors").exists()
    compiled = _run_script(script)
    assert compiled.returncode != 0 and "AssertionError" in compiled.stderr, compiled.stderr[-2000:]
    eager = _run_script(script, "--eager")
    assert eager.returncode == 0 and "ok" in eager.stdout, eager.stderr[-2000:]
    # Without the wrong lowering Inductor computes gelu right: the repro passes compiled too.
    fixed = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    # A region with nothing to reduce is refused with one line.
    missing = ["repro", str(buggy_run), "forward:nowhere:compiled.x:0", "-o", str(tmp_path / "x.py")]
    assert cli_main(missing) == 2
