"""msprobe config.json files map onto probe options; what cannot be honoured is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import probe
from probe import ProbeError
from probe.errors import ProbeWarning
from probe.msprobe_config import from_msprobe

# msprobe 26.x's packaged default config
DEFAULT = {
    "task": "statistics", "dump_path": "./dump_path", "rank": [], "step": [], "level": "L1",
    "extra_info": True, "async_dump": False,
    "statistics": {"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
    "tensor": {"scope": [], "list": [], "data_mode": ["all"]},
    "acc_check": {"white_list": [], "black_list": [], "error_data_path": "./"},
}


def test_default_config_maps_to_stats_with_inputs_and_stacks():
    # Each mode option reaches probe.mode as the property of its mode's object; the rest is common.
    assert from_msprobe(DEFAULT) == {
        "mode": [probe.Stats(inputs=True)], "out": "./dump_path", "stack": True, "async_flush": False,
    }


def test_tensor_task_with_ranges_selection_and_data_mode():
    config = {
        "task": "tensor", "dump_path": "/tmp/x", "rank": [0, "2-3"], "step": ["4-6"], "level": "mix",
        "tensor": {"list": ["relu", "Module.layers.0.Linear.forward.0"], "data_mode": ["forward", "output"]},
    }
    options = from_msprobe(config)
    assert options["mode"] == [probe.Stats(inputs=False), probe.Dump(tensors="outputs")]
    assert options["steps"] == ["4-6"] and options["ranks"] == [0, "2-3"]
    assert options["ops"] == ["*relu*"] and options["modules"] == ["layers.0", "layers.0.*"]
    assert options["phases"] == ["forward", "optimizer", "recompute"]
    assert "tensors" not in options and "inputs" not in options


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"task": "overflow_check"}, "first_nonfinite"),
        ({"task": "statistics", "level": "L2"}, "level 'L2' is not supported"),
        ({"task": "statistics", "dump_enable": True}, "'dump_enable' (hot reloading"),
        ({"task": "statistics", "statistics": {"summary_mode": "md5"}}, "summary_mode 'md5'"),
        ({"task": "statistics", "statistics": {"scope": ["linear", "relu"]}}, "'linear' is neither"),
        ({"task": "statistics", "statistics": {"data_mode": ["sideways"]}}, "data_mode ['sideways']"),
        ({"task": "statistics", "statistics": {"slice": []}}, "statistics.slice"),
        ({"task": "statistics", "dumppath": "/x"}, "key 'dumppath' is unknown"),
    ],
)
def test_unsupported_keys_are_errors_naming_them(config, message):
    with pytest.raises(ProbeError) as info:
        from_msprobe(config)
    assert message in str(info.value)


def test_keys_safe_to_ignore_warn_once():
    with pytest.warns(ProbeWarning, match="'risk_level' is ignored"):
        options = from_msprobe({"task": "statistics", "dump_path": "d", "risk_level": "FOCUS"})
    assert options["mode"] == [probe.Stats(inputs=True)]


def test_probe_mode_runs_from_an_msprobe_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "task": "tensor", "dump_path": str(tmp_path / "dump"), "rank": [], "step": [1], "level": "L1",
        "tensor": {"list": ["exp"], "data_mode": ["all"]},
    }))
    with probe.mode(config=config) as session:
        for _ in range(2):
            torch.randn(4).exp().neg()
            session.step()
    run = probe.load(tmp_path / "dump")
    assert run.steps == [1] and run.info["modes"] == ["stats", "dump"]
    (op,) = run.ops(1)
    assert op.name == "aten.exp.default" and op.inputs[0].stats is not None
    assert torch.equal(run.tensor(op.id, "output", 0, step=1), run.tensor(op.id, "input", 0, step=1).exp())


def test_free_benchmark_block_of_msprobe_8_3_3():
    config = {
        "task": "free_benchmark", "dump_path": "/tmp/fb", "level": "L1",
        "free_benchmark": {"scope": [], "list": ["softmax"], "fuzz_device": "cpu", "pert_mode": "to_cpu",
                           "handler_type": "fix", "fuzz_level": "L1", "fuzz_stage": "forward",
                           "if_preheat": False, "preheat_step": 15, "max_sample": 20},
    }
    options = from_msprobe(config)
    (free_benchmark,) = options["mode"]
    assert isinstance(free_benchmark, probe.FreeBenchmark)
    assert dict(free_benchmark.options) == {"perturb": "to_cpu", "handler": "fix", "preheat": False,
                                            "preheat_steps": 15, "max_sample": 20}
    assert options["phases"] == ["forward"] and options["ops"] == ["*softmax*"]
    with pytest.raises(ProbeError, match="fuzz_stage 'sideways'"):
        from_msprobe({"task": "free_benchmark", "free_benchmark": {"fuzz_stage": "sideways"}})


def test_the_adapters_objects_configure_a_session_as_the_flat_options_would(tmp_path):
    """A config's mode objects unfold as the config's keys: an option given directly still wins."""
    config = {"task": "statistics", "dump_path": str(tmp_path / "a"), "statistics": {"data_mode": ["output"]}}
    x = torch.randn(4)
    with probe.mode(config=config) as session:
        x.exp()
        session.step()
    (op,) = probe.load(tmp_path / "a").ops(0)
    assert op.outputs[0].stats is not None and op.inputs[0].stats is None  # inputs=False from data_mode
    config["dump_path"] = str(tmp_path / "b")
    with probe.mode(config=config, inputs=True) as session:  # the keyword wins over the config's object
        x.exp()
        session.step()
    (op,) = probe.load(tmp_path / "b").ops(0)
    assert op.inputs[0].stats is not None


def test_the_monitor_adapter_builds_a_monitor_object():
    from probe.modes.monitor.config import from_msprobe_monitor

    options = from_msprobe_monitor({"targets": {"layers.0": {}}, "ops": ["norm"], "module_ranks": [0]})
    (monitor,) = options.pop("mode")
    assert isinstance(monitor, probe.Monitor) and monitor.options["metrics"] == ("norm",)
    assert options == {"ranks": [0]}
