"""Bad options fail before anything is traced, naming the value and what is accepted."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import probe
from probe import ProbeError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"modes": "statz"}, "unknown mode 'statz'; accepted modes: ["),
        ({"modes": []}, "no mode given"),
        ({"modes": ["stats", "stats"]}, "names a mode twice"),
        ({"modes": "stats", "phases": ["forwards"]}, "option 'phases'"),
        ({"modes": "stats", "steps": [-1]}, "option 'steps': -1"),
        ({"modes": "stats", "steps": "3-1"}, "range '3-1' is empty"),
        ({"modes": "stats", "ranks": "x"}, "option 'ranks'"),
        ({"modes": "stats", "ops": 3}, "option 'ops'"),
        ({"modes": "stats", "modules": []}, "option 'modules'"),
        ({"modes": "stats", "stack": "yes"}, "option 'stack'"),
        ({"modes": "stats", "compiled": "maybe"}, "option 'compiled': 'maybe' is not one of"),
        ({"modes": "stats", "model": "net"}, "option 'model'"),
        ({"modes": "stats", "perturb": "add_noise"}, "unknown option 'perturb'"),
        ({"modes": "stats", "stats_backend": "gpu"}, "option 'stats_backend'"),
        ({"modes": "stats", "inputs": 1}, "option 'inputs'"),
    ],
)
def test_bad_options_raise_probe_error(tmp_path, kwargs, message):
    modes = kwargs.pop("modes")
    with pytest.raises(ProbeError, match=None) as info:
        probe.mode(modes, out=tmp_path / "r", **kwargs)
    assert message in str(info.value)
    assert not (tmp_path / "r").exists()


def test_non_empty_or_unusable_out_is_refused(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("user data")
    with pytest.raises(ProbeError, match="is not empty"):
        probe.mode("stats", out=full)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ProbeError, match="exists and is not a directory"):
        probe.mode("stats", out=a_file)
    with pytest.raises(ProbeError, match="cannot create"):
        probe.mode("stats", out=a_file / "sub")


def test_overwrite_replaces_a_previous_run(tmp_path):
    for value in (1.0, 2.0):
        with probe.mode("stats", out=tmp_path / "r", overwrite=True):
            torch.full((3,), value).exp()
    ops = probe.load(tmp_path / "r").ops(0)
    assert ops[-1].outputs[0].stats["max"] == pytest.approx(torch.tensor(2.0).exp().item())


def test_config_file_supplies_options(tmp_path):
    config = tmp_path / "probe.json"
    config.write_text(json.dumps({"mode": "stats", "ops": ["exp"], "phases": ["forward"]}))
    with probe.mode(config=config, out=tmp_path / "r"):
        torch.ones(2).exp().neg()
    assert [op.name for op in probe.load(tmp_path / "r").ops(0)] == ["aten.exp.default"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mode": "stats", "levle": "L1"}))
    with pytest.raises(ProbeError, match="unknown option 'levle'"):
        probe.mode(config=bad, out=tmp_path / "r2")
    with pytest.raises(ProbeError, match="does not exist"):
        probe.mode(config=tmp_path / "missing.json", out=tmp_path / "r3")


def test_sessions_do_not_nest(tmp_path):
    with (
        probe.mode("stats", out=tmp_path / "a"),
        pytest.raises(ProbeError, match="already active"),
        probe.mode("stats", out=tmp_path / "b"),
    ):
        pass


def _train_three_steps(out, steps) -> list[str]:
    """Messages of the probe warnings a 3-step training loop under ``steps=`` gave."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with probe.mode("stats", out=out, model=model, steps=steps) as session:
            for _ in range(3):
                model(torch.randn(2, 4)).sum().backward()
                session.step()
    return [str(w.message) for w in caught if isinstance(w.message, probe.ProbeWarning)]


def test_selected_steps_the_session_never_reached_are_warned_about_at_stop(tmp_path):
    # Before: steps=[100] in a 3-step run gave an empty run and no word.
    (message,) = _train_three_steps(tmp_path / "a", [100])
    assert "100" in message and "steps 0-2" in message and "none of the selected steps" in message
    assert probe.load(tmp_path / "a").steps == []

    (message,) = _train_three_steps(tmp_path / "b", "1,3,5-8")
    assert "3, 5-8" in message and "none of the selected" not in message
    assert probe.load(tmp_path / "b").steps == [1]

    assert _train_three_steps(tmp_path / "c", "0-2") == []  # every selected step ran
    assert _train_three_steps(tmp_path / "d", None) == []
