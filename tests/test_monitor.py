"""The training-state monitor: alerts where a fault is planted and nowhere else,
values equal to a direct recomputation, bit-identical training, msprobe's
config form, the stop/dump options, TensorBoard output, cross-rank reduction."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import probe
from probe import ProbeError
from probe.errors import ProbeWarning
from tests.conftest import SharedBlockNet, train_steps

ALL_SLOTS = {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0", "output_grad": "tensor"}
PLANT_STEP = 6


def _train(tmp_path, steps=12, plant=None, fault="explode", **options):
    """SharedBlockNet under the monitor; ``plant``: the step at which the gradient of
    ``inp``'s output is multiplied by 1000 (or its output made NaN, ``fault="nan"``)."""
    torch.manual_seed(0)
    model = SharedBlockNet()
    counter = {"step": 0}

    def fault_hook(module, args, out):
        if counter["step"] != plant:
            return None
        if fault == "nan":
            return out * torch.nan
        out.register_hook(lambda g: g * 1e3)
        return None

    model.inp.register_forward_hook(fault_hook)
    out = tmp_path / "run"
    session = probe.mode("monitor", out=out, model=model, **options)

    class Stepper:
        def step(self):
            session.step()
            counter["step"] += 1

    with session:
        train_steps(model, steps, session=Stepper())
    return probe.load(out)


def test_a_planted_gradient_explosion_raises_exactly_one_alert_there(tmp_path):
    run = _train(tmp_path, plant=PLANT_STEP, targets={"*": {"output": "tensor", "output_grad": "tensor"}})
    (alert,) = run.anomalies()
    assert (alert.step, alert.module, alert.metric, alert.rule) == (PLANT_STEP, "inp", "output_grad.norm",
                                                                    "turbulence")
    assert alert.value > 100 * alert.baseline
    # The step the fault leaves is not an alert: the spike never entered the average.


def test_a_healthy_run_raises_no_alert(tmp_path):
    run = _train(tmp_path, targets={"*": ALL_SLOTS}, wg_distribution=True, mv_distribution=True,
                 ur_distribution=True)
    assert run.steps == list(range(12))
    assert run.anomalies() == []
    kinds = {m.kind for m in run.monitor(3)}
    assert kinds == {"activation", "weight_grad", "exp_avg", "exp_avg_sq", "update", "weight", "update_ratio"}


def test_a_nan_is_an_alert_at_once_even_during_warm_up(tmp_path):
    run = _train(tmp_path, steps=3, plant=1, fault="nan", targets={"inp": {"output": "tensor"}})
    first = run.anomalies()[0]
    assert (first.step, first.module, first.metric, first.rule) == (1, "inp", "output.nan", "nonfinite")
    assert first.value == 16 * 4  # every element of inp's [4, 16] output
    assert [a for a in run.anomalies() if a.step == 0] == []


def _direct(t: torch.Tensor, eps: float) -> dict[str, float]:
    x = t.detach().double()
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(), "norm": x.norm().item(),
            "zeros": float((x.abs() < eps).sum()), "nan": float(x.isnan().sum())}


def test_monitor_values_equal_a_direct_recomputation(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    seen: dict[tuple[str, str, str, int], torch.Tensor] = {}
    calls = {"block.fc": 0}

    def capture(name):
        def hook(module, args, out):
            call = calls.get(name, 0)
            if name in calls:
                calls[name] += 1
            seen[("activation", name, "input", call)] = args[0].detach().clone()
            seen[("activation", name, "output", call)] = out.detach().clone()
            grad_key = ("activation", name, "output_grad", call)
            out.register_hook(lambda g: seen.__setitem__(grad_key, g.clone()))

        return hook

    for name in ("inp", "block.fc", "head"):
        model.get_submodule(name).register_forward_hook(capture(name))
    eps = 1e-3
    opt_state = {}

    def after_opt(optimizer, args, kwargs):
        for p in model.parameters():
            opt_state[p] = optimizer.state[p]["exp_avg"].clone()

    from torch.optim.optimizer import register_optimizer_step_post_hook

    remove = register_optimizer_step_post_hook(after_opt)
    try:
        with probe.mode("monitor", out=tmp_path / "run", model=model, eps=eps, mv_distribution=True,
                        targets=["inp", "block.fc", "head"]) as session:
            train_steps(model, 1, session=session)
    finally:
        remove.remove()
    run = probe.load(tmp_path / "run")
    rows = {(m.kind, m.name, m.slot, m.call): m for m in run.monitor(0)}
    # targets given as a list of globs watch outputs and output gradients
    assert {k for k in rows if k[0] == "activation"} == {k for k in seen if k[2] in ("output", "output_grad")}
    assert len(rows) > 8
    for key, row in rows.items():
        if key[0] == "activation":
            want = _direct(seen[key], eps)
        elif key[0] == "exp_avg":
            param = dict(model.named_parameters())[key[1]]
            want = _direct(opt_state[param], eps)
        else:
            continue
        for metric, value in want.items():
            assert getattr(row, metric) == pytest.approx(value, rel=1e-6, abs=1e-12), (key, metric)


def test_the_update_ratio_is_the_step_adam_took(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet().eval()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # no weight decay: the update is the whole step
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets=["head"],
                    ur_distribution=True) as session:
        for _ in range(3):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            session.step()
    run = probe.load(tmp_path / "run")
    for name, param in model.named_parameters():
        step = (param.detach() - before[name]).double()
        update = next(m for m in run.monitor(2) if m.kind == "update" and m.name == name)
        ratio = next(m for m in run.monitor(2) if m.kind == "update_ratio" and m.name == name)
        assert update.norm == pytest.approx(step.norm().item(), rel=1e-4), name
        assert ratio.norm == pytest.approx(step.norm().item() / param.detach().double().norm().item(),
                                           rel=1e-4), name


def test_training_is_bit_identical_with_the_monitor_on(tmp_path):
    torch.manual_seed(0)
    plain_model = SharedBlockNet()
    plain = train_steps(plain_model, 3)
    rng_plain = torch.get_rng_state()
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("monitor", out=tmp_path / "run", model=model, targets={"*": ALL_SLOTS},
                    wg_distribution=True, mv_distribution=True, ur_distribution=True,
                    param_distribution=True) as session:
        traced = train_steps(model, 3, session=session)
    for a, b in zip(plain[0], traced[0], strict=True):
        assert torch.equal(a, b)
    for name in plain[1]:
        assert torch.equal(plain[1][name], traced[1][name]), name
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(rng_plain, torch.get_rng_state())
    assert probe.load(tmp_path / "run").ops(0) == []  # hooks only: no op was traced


def test_with_the_stats_mode_the_monitors_own_reductions_are_not_traced(tmp_path):
    def ops(modes, out, **options):
        torch.manual_seed(0)
        model = SharedBlockNet()
        with probe.mode(modes, out=out, model=model, **options) as session:
            train_steps(model, 1, session=session)
        return [(op.id, op.name) for op in probe.load(out).ops(0)]

    alone = ops("stats", tmp_path / "a")
    both = ops(["stats", "monitor"], tmp_path / "b", targets={"*": ALL_SLOTS}, wg_distribution=True)
    assert both == alone
    assert probe.load(tmp_path / "b").monitor(0)


def test_on_anomaly_stop_stops_training_at_the_step(tmp_path):
    with pytest.raises(probe.AnomalyStop) as stopped:
        _train(tmp_path, plant=PLANT_STEP, on_anomaly="stop",
               targets={"*": {"output": "tensor", "output_grad": "tensor"}})
    assert [a.step for a in stopped.value.anomalies] == [PLANT_STEP]
    run = probe.load(tmp_path / "run")
    assert run.steps[-1] == PLANT_STEP and len(run.anomalies()) == 1


def test_on_anomaly_dump_saves_the_modules_tensors_of_that_step(tmp_path):
    from safetensors.torch import load_file

    run = _train(tmp_path, plant=PLANT_STEP, on_anomaly="dump",
                 targets={"*": {"output": "tensor", "output_grad": "tensor"}})
    assert len(run.anomalies()) == 1
    step_dir = tmp_path / "run" / "rank0" / f"step{PLANT_STEP}"
    tensors = load_file(step_dir / "anomaly_tensors.safetensors")
    assert set(tensors) == {"inp[0].output", "inp[0].output_grad"}
    grad_row = next(m for m in run.monitor(PLANT_STEP) if m.name == "inp" and m.slot == "output_grad")
    assert tensors["inp[0].output_grad"].double().norm().item() == pytest.approx(grad_row.norm, rel=1e-6)
    assert not (tmp_path / "run" / "rank0" / "step5" / "anomaly_tensors.safetensors").exists()


def test_a_user_rule_hook_raises_its_own_alerts(tmp_path):
    def big_output(observation):
        series = observation.series
        if series.slot == "output" and observation.step == 2 and series.name == "head":
            return "planted by the test"
        return None

    run = _train(tmp_path, steps=4, targets={"head": {"output": "tensor"}}, anomaly_rules=[big_output])
    (alert,) = run.anomalies()
    assert (alert.step, alert.module, alert.rule, alert.reason) == (2, "head", "rule:big_output",
                                                                    "planted by the test")


def test_msprobe_monitor_config_file(tmp_path):
    from probe.demo.train import DemoTraining, train

    config = {
        "targets": {f"layers.{i}": {"input": "tuple[1]:0", "output": "tensor", "input_grad": "tuple[1]:0",
                                    "output_grad": "tensor"} for i in range(2)},
        "module_ranks": "0", "xy_distribution": True, "wg_distribution": True, "ops": ["norm", "nans"],
        "eps": 1e-8, "start_step": 1, "step_interval": 2, "format": "csv",
        "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    }
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    training = DemoTraining()
    with pytest.warns(ProbeWarning, match="'format' ignored"):
        session = probe.mode(config=path, out=tmp_path / "run", model=training.model)
    train(training, 4, session=session)
    run = probe.load(tmp_path / "run")
    assert run.steps == [1, 3]  # start_step 1, every 2nd step
    names = {(m.name, m.slot) for m in run.monitor(1) if m.kind == "activation"}
    assert names == {(f"layers.{i}", s) for i in range(2) for s in ALL_SLOTS}
    assert any(m.kind == "weight_grad" for m in run.monitor(3))


@pytest.mark.parametrize(("options", "message"), [
    ({"targets": {"nope.*": {"output": "tensor"}}}, "match no module"),
    ({"targets": {"*": {"output": "tuple[2]:2"}}}, "'tuple[2]:2' is not 'tensor'"),
    ({"targets": {"*": {"outptu": "tensor"}}}, "unknown slot(s) ['outptu']"),
    ({"targets": ["*"], "metrics": ["norm", "p99"]}, "'metrics'"),
    ({"targets": ["*"], "on_anomaly": "panic"}, "'panic' is not one of"),
    ({"targets": ["*"], "alert": {"rules": [{"rule_name": "AnomalyGuess"}]}}, "'AnomalyGuess' is unknown"),
    ({"xy_distribution": True}, "needs option 'targets'"),
])
def test_bad_monitor_options_name_the_value(tmp_path, options, message):
    with pytest.raises(ProbeError) as error, probe.mode("monitor", out=tmp_path / "run",
                                                        model=SharedBlockNet(), **options):
        pass
    assert message in str(error.value)


def test_msprobe_keys_we_cannot_honour_are_refused(tmp_path):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"targets": {"*": {"output": "tensor"}}, "cc_distribution": {"enable": True}}))
    with pytest.raises(ProbeError, match="cc_distribution"):
        probe.mode(config=path, out=tmp_path / "run")


def test_tensorboard_events_hold_the_csv_values(tmp_path):
    module = "tensorboard.backend.event_processing.event_accumulator"
    # A test extra: CI (PROBE_REQUIRE_TOOLS=1) must have it.
    if os.environ.get("PROBE_REQUIRE_TOOLS") == "1":
        import importlib

        event_accumulator = importlib.import_module(module)
    else:
        event_accumulator = pytest.importorskip(module)
    run = _train(tmp_path, steps=2, targets={"head": {"output": "tensor"}})
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "rank0" / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("activation/head/output/norm")
    assert [s.step for s in scalars] == [0, 1]
    for scalar in scalars:
        row = next(m for m in run.monitor(scalar.step) if m.name == "head")
        assert scalar.value == pytest.approx(row.norm, rel=1e-6)


def test_the_model_itself_is_a_target_named_empty(tmp_path):
    # "" is the root module's name in named_modules(): its output (the logits) and their gradient.
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = _train(tmp_path, steps=2, targets=[""])
    rows = run.monitor(1)
    assert {(r.kind, r.name, r.slot) for r in rows} == {("activation", "", "output"),
                                                        ("activation", "", "output_grad")}
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "rank0" / "tensorboard"))
    events.Reload()
    output = next(r for r in rows if r.slot == "output")
    assert events.Scalars("activation/<model>/output/norm")[-1].value == pytest.approx(output.norm, rel=1e-6)


def _reduce_worker(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = SharedBlockNet().eval()  # no dropout: the test recomputes the outputs
        # No overwrite needed: each rank only checks its own rank directory.
        with probe.mode("monitor", out=out, model=model, targets={"head": {"output": "tensor"}},
                        reduce_ranks=True) as session:
            x = torch.full((4, 8), float(rank + 1))  # rank 0 and rank 1 see different data
            model(x)
            session.step()
    finally:
        dist.destroy_process_group()


def test_reduce_ranks_combines_the_ranks_values(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    mp.spawn(_reduce_worker, args=(2, str(out), port), nprocs=2, join=True)
    torch.manual_seed(0)
    model = SharedBlockNet().eval()
    both = torch.cat([model(torch.full((4, 8), 1.0)), model(torch.full((4, 8), 2.0))]).detach().double()
    run = probe.load(out)
    for rank in (0, 1):
        (row,) = run.monitor(0, rank)
        assert row.numel == both.numel()
        assert row.min == pytest.approx(both.min().item()) and row.max == pytest.approx(both.max().item())
        assert row.norm == pytest.approx(both.norm().item(), rel=1e-9)
        assert row.mean == pytest.approx(both.mean().item(), rel=1e-9)
    assert math.isfinite(row.norm)


def _scan(values: list[float], nans: list[int] | None = None) -> list[int]:
    """Steps at which the default rules alert on a norm series with these values."""
    import numpy as np

    from probe.modes.monitor.anomaly import AnomalyDetector, Series
    from probe.modes.monitor.options import Monitor
    from probe.modes.statistics.columns import MONITOR_COLUMNS as METRIC_COLUMNS

    detector = AnomalyDetector(Monitor(targets=["x"]))
    series = Series("activation", "x", "output")
    alerts = []
    for step, value in enumerate(values):
        row = np.zeros((1, len(METRIC_COLUMNS)))
        row[0, METRIC_COLUMNS.index("norm")] = value
        row[0, METRIC_COLUMNS.index("nan")] = (nans or [0] * len(values))[step]
        alerts += [a.step for a in detector.scan(step, 0, [series], row)]
    return alerts


def test_rules_alert_once_per_episode():
    calm = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]
    assert _scan(calm + [1.0] * 5) == []
    assert _scan(calm + [50.0] + [1.0] * 5) == [7]  # a spike: one alert, none when it falls back
    assert _scan(calm + [0.01] + [1.0] * 5) == [7]  # a collapse counts too
    # A new level: one alert, then (after warm-up values at it) the new normal.
    assert _scan(calm + [8.0] * 10) == [7]
    assert _scan(calm + [8.0] * 10 + [100.0]) == [7, 17]
    # NaN from step 2 on: one alert, and one more when it comes back after finite steps.
    nans = [0, 0, 1, 1, 1, 0, 0, 1, 0]
    assert _scan([1.0] * 9, nans) == [2, 7]


@pytest.mark.parametrize("targets", [
    {"": {}},  # the model itself, default slots ("tensor")
    # msprobe's full monitoring (the model's input: keyword arguments only, nothing positional)
    {"*": {slot: "tuple[1]:0" for slot in ("input", "output", "input_grad", "output_grad")}},
])
def test_an_hf_model_output_is_monitored_as_its_first_field_without_a_warning(tmp_path, targets):
    """An HF model returns a ModelOutput (a mapping): before, target '' warned that it has no
    tensor output."""
    import warnings

    from tests.hf_models import tiny_llama

    model = tiny_llama()
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.mode("monitor", out=tmp_path / "m", model=model, targets=targets) as session:
            output = model(input_ids=tokens, labels=tokens)
            output.loss.backward()
            session.step()
    said = [str(w.message) for w in caught if issubclass(w.category, ProbeWarning)]
    assert not [m for m in said if "does not fit" in m], said
    series = {(m.name, m.slot): m for m in probe.load(tmp_path / "m").monitor(0)}
    loss = float(output.loss)
    assert series[("", "output")].norm == pytest.approx(abs(loss), rel=1e-6)  # HF's output[0]: the loss
    assert series[("", "output_grad")].norm == pytest.approx(1.0)  # d loss / d loss


def test_a_diverging_run_writes_tensorboard_values_past_float32_without_numpy_warnings(tmp_path):
    """Outputs near float32's largest value: their fp64 norm is past float32's range. Before, the
    TensorBoard writer's cast printed numpy's raw 'overflow encountered in cast'."""
    import warnings

    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(8e37)  # each output 3.2e38: finite in float32, their norm is not
        model.bias.zero_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.mode("monitor", out=tmp_path / "run", model=model, targets=[""]) as session:
            model(torch.ones(1, 4)).sum().backward()
            session.step()
    numpy_said = [str(w.message) for w in caught if "overflow" in str(w.message)]
    assert not numpy_said, numpy_said
    (row,) = [m for m in probe.load(tmp_path / "run").monitor(0) if m.slot == "output"]
    assert row.norm == pytest.approx(float(torch.tensor([3.2e38, 3.2e38]).double().norm()), rel=1e-6)
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "rank0" / "tensorboard"))
    events.Reload()
    (written,) = events.Scalars("activation/<model>/output/norm")
    assert written.value == float(np.finfo(np.float32).max)  # clipped on purpose: the chart shows the climb
