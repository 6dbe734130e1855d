"""The issue-16 benchmark entries run: the HF workloads in the overhead harness, with DebugMode."""

from __future__ import annotations

import pytest

from benchmarks import overhead
from benchmarks.models import MODELS, WorkloadSpec


def test_hf_llama_small_spec_trains_and_describes_itself():
    spec = MODELS["hf-llama-small"]
    assert isinstance(spec, WorkloadSpec)
    trainer = spec.trainer()
    loss = trainer.step()
    assert loss.isfinite()
    assert spec.num_params() == sum(p.numel() for p in trainer.model.parameters())
    assert "hidden 256" in spec.describe() and "seq 128" in spec.with_seq(128).describe()


@pytest.mark.slow
def test_overhead_harness_times_stats_beside_debugmode(capsys):
    assert overhead.main(["--model", "hf-llama-small", "--steps", "1", "--warmup", "0", "--peers",
                          "--configs", "probe-stats", "--markdown"]) == 0  # --peers adds its row
    out = capsys.readouterr().out
    assert "| probe-stats |" in out and "| debugmode |" in out


def test_overhead_rows_give_each_overhead_as_a_multiple_of_the_bare_modes():
    # Issue 22 item 6 states its targets so: (config - untraced) / (bare mode - untraced).
    def runs(wall: float, cpu: float, ops: int | None = None) -> list[overhead.Sample]:
        return [overhead.Sample(wall, ops, cpu)] * 3

    rows = {row.name: row for row in overhead.summarize({
        "baseline": runs(1.0, 0.8), "passthrough": runs(1.2, 0.9, 100),
        "probe-structure": runs(1.3, 1.1, 100), "debugmode": runs(1.5, 0.95),
    })}
    assert rows["baseline"].overhead_vs_bare is None
    assert rows["passthrough"].overhead_vs_bare == pytest.approx(1.0)
    assert rows["probe-structure"].overhead_vs_bare == pytest.approx(1.5)
    assert rows["probe-structure"].cpu_overhead_vs_bare == pytest.approx(3.0)
    assert rows["debugmode"].overhead_vs_bare == pytest.approx(2.5)
    assert rows["probe-structure"].cpu_ms == pytest.approx(1100.0)
    cells = overhead.row_cells(rows["probe-structure"])
    assert cells[overhead.COLUMNS.index("x bare ovh")] == "1.50"
    assert cells[overhead.COLUMNS.index("x bare ovh (cpu)")] == "3.00"
    # No overhead to compare with (the bare mode as fast as no mode): no ratio, not a division by 0.
    flat = overhead.summarize({"baseline": runs(1.0, 1.0), "passthrough": runs(1.0, 1.0, 5)})
    assert flat[1].overhead_vs_bare is None



def test_the_python_floor_links_each_value_to_the_op_that_made_it():
    import torch

    x = torch.randn(4, 4)
    with overhead.PythonFloorMode() as floor, overhead.CountingMode() as counted:
        z = (x * 2 + 1).t()
    assert len(floor.records) == counted.ops == 3
    (mul, _, mul_sources, _), (add, _, add_sources, _), (_, _, t_sources, t_shapes) = floor.records
    assert mul_sources == (None,)  # x came from outside
    assert add_sources == ((mul, 0),) and t_sources == ((add, 0),)
    assert t_shapes == ((4, 4),) == (tuple(z.shape),)


def test_overhead_harness_counts_python_calls_per_op(capsys):
    # Host work per op counted (issue 35): deterministic where a shared machine's clock is not.
    configs = [overhead.Baseline(), overhead.Passthrough(), overhead.PythonFloor()]
    trainers = [overhead.MODELS["demo"].trainer() for _ in configs]
    for config, trainer in zip(configs, trainers, strict=True):
        config.run_step(trainer)  # warm: the first step builds the optimizer's state
    calls = overhead.calls_per_op(configs, trainers)
    assert set(calls) == {"passthrough", "python-floor"}
    # The floor does all the bare mode does per op, and more: a lookup per input, a record.
    assert 0 < calls["passthrough"] < calls["python-floor"]
    assert overhead.main(["--model", "demo", "--steps", "1", "--warmup", "0", "--configs",
                          "python-floor", "--calls", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| measure | value |\n|---|---:|\n| passthrough |" in out
