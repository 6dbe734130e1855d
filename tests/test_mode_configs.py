"""A mode's config is one kw-only dataclass: its fields are the options, validated in one place,
namespaced per mode, and the option table in docs/options.md is generated from them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import run_modes

import probe
from probe.modes.base import Mode
from probe.modes.config import CONFIGS, ModeConfig
from probe.modes.registry import MODES, register_mode
from probe.option_docs import PAGE, option_table, options_page
from probe.rundir.mode_files import _READERS
from probe.vocabulary.option_fields import integer, option


@pytest.mark.parametrize(("stats", "monitor"), [(True, False), (False, True)])
def test_two_modes_keep_their_own_value_of_a_shared_option(tmp_path, stats, monitor):
    session = run_modes(tmp_path / "run", [probe.Stats(distribution=stats),
                                           probe.Monitor(targets=["inp", "head"], distribution=monitor)])
    by_name = {m.name: m.config for m in session.modes}
    assert (by_name["stats"].distribution, by_name["monitor"].distribution) == (stats, monitor)
    run = probe.load(tmp_path / "run")
    outputs = [t for op in run.ops(step=1) for t in op.outputs if t.stats is not None]
    series = run.monitor(1)
    assert outputs and series
    # Each mode recorded distributions exactly when its own value said so.
    assert all((t.distribution is not None) is stats for t in outputs)
    assert all((s.distribution is not None) is monitor for s in series)
    assert session.options.mode_options == {"stats.distribution": stats, "monitor.distribution": monitor,
                                            "targets": ["inp", "head"]}


def test_a_keyword_option_still_goes_to_every_mode_that_declares_it(tmp_path):
    session = probe.mode("stats+monitor", out=tmp_path / "run", targets=["0"], distribution=True)
    assert [m.config.distribution for m in session.modes if m.name in ("stats", "monitor")] == [True, True]
    assert session.options.modes == ("stats", "monitor")


@pytest.fixture
def toy_mode():
    """A toy mode registered for one test (taken out of the registries after it)."""
    @dataclass(frozen=True, kw_only=True, eq=False)
    class Toy(ModeConfig):
        """A toy mode's config."""

        mode = "toy"
        level: int = option(1, check=integer(2), doc="how deep the toy looks")

    @register_mode
    class ToyMode(Mode):
        name = "toy"
        config_class = Toy

    yield Toy
    for registry in (MODES, CONFIGS, _READERS):
        registry.pop("toy", None)


def test_a_field_added_to_a_config_is_validated_and_documented_without_a_parse_call(tmp_path, toy_mode):
    with pytest.raises(probe.ProbeError, match=r"option 'level': expected an int >= 2, got 1"):
        probe.mode("toy", out=tmp_path / "a", level=1)
    with pytest.raises(probe.ProbeError, match=r"option 'level': expected an int >= 2, got 'deep'"):
        toy_mode(level="deep")
    with pytest.raises(probe.ProbeError, match=r"unknown option 'depth' for mode\(s\) \['toy'\]"):
        probe.mode("toy", out=tmp_path / "b", depth=3)
    session = probe.mode("toy", out=tmp_path / "c", level=3)
    assert session.modes[0].config.level == 3 and session.modes[0].option_names == {"level"}
    assert probe.mode(toy_mode(level=4), out=tmp_path / "d").modes[0].config.level == 4
    assert "| `level` | `1` | int >= 2 | how deep the toy looks |" in option_table(toy_mode)


def test_the_docs_option_table_is_generated_from_the_configs():
    assert PAGE.read_text() == options_page(), "docs/options.md is stale: run python -m probe.option_docs"
