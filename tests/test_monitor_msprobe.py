"""The monitor on msprobe 26's own configs (copied from its monitor guide,
docs/zh/monitor_instruct.md, module names changed to GPT-2's), slot specs for every
slot, alerts grouped into incidents, and ``modules=`` as targets, on HF GPT-2."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from hf_models import tiny_gpt2

import probe
from probe import ProbeError
from probe.cli import main
from probe.errors import ProbeWarning

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

# The guide's examples, verbatim but for module names.
QUICK_START = {"targets": {}, "collect_times": 3, "wg_distribution": True, "format": "csv",
               "ops": ["min", "max", "mean", "norm"], "ndigits": 16}
WEIGHTS = {"targets": {}, "param_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
ACTIVATIONS = {"targets": {}, "xy_distribution": True, "forward_only": False, "backward_only": False,
               "all_xy": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
OPTIMIZER = {"targets": {}, "mv_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
NAMED_PARAMETERS = {"targets": {"transformer.h.0.mlp": {}, "transformer.wte.weight": {}},
                    "mv_distribution": True, "format": "csv", "ops": ["norm", "min", "max", "nans"]}
# "详细配置" (the full config), its communication block disabled as msprobe allows, the
# micro-batch gradients off, and msprobe's identity metric "id" among the ops.
DETAILED = {
    "targets": {"transformer.h.0.mlp": {"input": "tuple[2]:0", "output": "tensor", "input_grad": "tuple[2]:0",
                                        "output_grad": "tuple[1]:0"}},
    "dynamic_on": False, "start_step": 0, "collect_times": 100000000, "step_interval": 1,
    "print_struct": False, "module_ranks": [0, 1, 2, 3], "ur_distribution": True, "xy_distribution": True,
    "all_xy": True, "forward_only": False, "backward_only": False, "mv_distribution": True,
    "param_distribution": True, "wg_distribution": True, "monitor_mbs_grad": False,
    "cc_distribution": {"enable": False, "cc_codeline": []},
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean", "id"], "eps": 1e-8,
    "ndigits": 12, "step_count_per_record": 1, "append_output": [], "squash_name": True,
}


def _gpt2():
    return tiny_gpt2(vocab_size=64, n_positions=32, n_embd=16, n_head=2, attn_implementation="eager")


def _train(model, session, steps=2, plant=None, lr=1e-3):
    """AdamW steps on fixed data; ``plant``: (step, parameter name, factor) scaled before that step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    with session:
        for step in range(steps):
            if plant is not None and step == plant[0]:
                with torch.no_grad():
                    model.get_parameter(plant[1]).mul_(plant[2])
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()


def _run_config(tmp_path, config, **options):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps(config))
    model = _gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)  # msprobe's "format", "ndigits": said once, ignored
        session = probe.mode(config=path, out=tmp_path / "run", model=model, **options)
    _train(model, session)
    return model, probe.load(tmp_path / "run")


def _kinds(run, step=1):
    return {(m.kind, m.name, m.slot) for m in run.monitor(step)}


def test_the_guide_s_weight_gradient_config_watches_every_gradient(tmp_path):
    model, run = _run_config(tmp_path, QUICK_START)
    names = {name for kind, name, _ in _kinds(run) if kind == "weight_grad"}
    assert names == {n for n, p in model.named_parameters()}
    assert not {kind for kind, _, _ in _kinds(run)} - {"weight_grad"}  # msprobe's xy default: off


@pytest.mark.parametrize(("config", "kinds"), [
    (WEIGHTS, {"weight"}), (OPTIMIZER, {"exp_avg", "exp_avg_sq"}),
    (NAMED_PARAMETERS, {"exp_avg", "exp_avg_sq"}),
])
def test_the_guide_s_parameter_configs(tmp_path, config, kinds):
    model, run = _run_config(tmp_path, config)
    series = _kinds(run)
    assert {kind for kind, _, _ in series} == kinds
    assert {name for _, name, _ in series} == {n for n, p in model.named_parameters()}


def test_the_guide_s_activation_config_watches_every_module_s_four_slots(tmp_path):
    _, run = _run_config(tmp_path, ACTIVATIONS)
    series = _kinds(run)
    for module in ("transformer.h.0.mlp", "transformer.h.1.attn.c_attn", "lm_head"):
        assert {slot for kind, name, slot in series if name == module} == {
            "input", "output", "input_grad", "output_grad"}, module


def test_the_guide_s_detailed_config_with_its_communication_block_disabled(tmp_path):
    _, run = _run_config(tmp_path, DETAILED)
    series = _kinds(run)
    mlp = {slot for kind, name, slot in series if name == "transformer.h.0.mlp"}
    assert mlp == {"input", "output", "input_grad", "output_grad"}
    assert {kind for kind, _, _ in series} >= {"activation", "weight_grad", "weight", "exp_avg", "update",
                                               "update_ratio"}


def test_output_grad_tuple_spec_is_the_gradient_of_a_tensor_output(tmp_path):
    model = _gpt2()
    seen = {}
    def keep_grad(module, args, out):
        out.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))

    model.transformer.h[1].mlp.register_forward_hook(keep_grad)
    slots = {"output_grad": "tuple[1]:0", "input_grad": "tuple[1]"}  # msprobe: no index is element 0
    session = probe.mode("monitor", out=tmp_path / "run", model=model, targets={"transformer.h.1.mlp": slots})
    _train(model, session, steps=1)
    rows = {(m.slot): m for m in probe.load(tmp_path / "run").monitor(0)}
    assert set(rows) == {"output_grad", "input_grad"}
    assert rows["output_grad"].norm == pytest.approx(seen["grad"].double().norm().item(), rel=1e-6)


@pytest.mark.parametrize("spec", ["list[2]:0", "tuple[2]:5", "tuple", "dict"])
def test_an_unsupported_spec_is_an_error_naming_it(tmp_path, spec):
    path = tmp_path / "monitor.json"
    config = {"targets": {"transformer.h.0.mlp": {"output_grad": spec}}, "xy_distribution": True}
    path.write_text(json.dumps(config))
    with pytest.raises(ProbeError, match=r"output_grad.*" + spec.replace("[", r"\[").replace("]", r"\]")):
        probe.mode(config=path, out=tmp_path / "run", model=_gpt2())


def test_a_spec_that_does_not_fit_the_module_is_said_not_silent(tmp_path):
    model = _gpt2()
    session = probe.mode("monitor", out=tmp_path / "run", model=model,
                         targets={"transformer.h.0.mlp": {"output": "tuple[3]:2"}})
    message = r"'transformer.h.0.mlp' output: 'tuple\[3\]:2' does not fit .* a tensor"
    with pytest.warns(ProbeWarning, match=message):
        _train(model, session, steps=1)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("cc_distribution", {"enable": True}, r"'cc_distribution' = \{'enable': True\}"),
    ("monitor_mbs_grad", True, "'monitor_mbs_grad' = True"),
    ("ops", ["norm", "p99"], r"'ops': \['norm', 'p99'\]"),
    ("ops", ["norm", "shape"], "'ops': 'shape' cannot be honoured"),
])
def test_what_cannot_be_honoured_is_an_error_naming_key_and_value(tmp_path, key, value, message):
    path = tmp_path / "monitor.json"
    path.write_text(json.dumps({"targets": {}, "wg_distribution": True, key: value}))
    with pytest.raises(ProbeError, match=message):
        probe.mode(config=path, out=tmp_path / "run", model=_gpt2())


def test_modules_serve_as_monitor_targets(tmp_path):
    model = _gpt2()
    session = probe.mode("monitor", out=tmp_path / "run", model=model, modules=["transformer.h.?.mlp"])
    _train(model, session, steps=1)
    series = {(m.name, m.slot) for m in probe.load(tmp_path / "run").monitor(0)}
    assert series == {(f"transformer.h.{i}.mlp", slot) for i in (0, 1) for slot in ("output", "output_grad")}


PLANT_STEP = 5


def test_a_planted_gradient_explosion_is_one_incident(tmp_path, caplog, capsys):
    from probe.modes.monitor.anomaly import incidents

    model = _gpt2()
    session = probe.mode("monitor", out=tmp_path / "run", model=model, modules=["transformer.h.*"],
                         wg_distribution=True)
    with caplog.at_level(logging.WARNING, logger="probe.monitor"):
        # A small learning rate: the healthy steps stay within the band (no alert before the plant).
        _train(model, session, steps=8, plant=(PLANT_STEP, "transformer.h.1.mlp.c_fc.weight", 100.0), lr=1e-4)
    run = probe.load(tmp_path / "run")
    alerts = run.anomalies()
    assert len(alerts) > 5 and all(a.step >= PLANT_STEP for a in alerts)  # the flood the issue saw
    (incident,) = incidents(alerts)
    assert {a.incident for a in alerts} == {PLANT_STEP}
    # Rooted at the earliest series recorded in the step: the scaled layer's forward output.
    assert (incident.first_step, incident.root.module, incident.root.metric) == (
        PLANT_STEP, "transformer.h.1.mlp.c_fc", "output.norm")
    assert incident.alerts == len(alerts)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "incident at step 5" in lines[0] and "transformer.h.1.mlp.c_fc" in lines[0]
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "run")]) == 0
    summary = [line for line in capsys.readouterr().out.splitlines() if "incident at" in line]
    assert len(summary) == 1 and "transformer.h.1.mlp.c_fc output.norm" in summary[0]
