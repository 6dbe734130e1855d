"""A new mode is one package and one registration (issue 34, "Done when"): the toy mode of
``tests/toy_mode/`` is traced, written, read back through ``probe.load(...).mode("toy")`` and
configured from another tool's config file, and it imports nothing but what every mode may read."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from conftest import train_in
from test_layers import imports_of, probe_modules

import probe
from probe.modes.config import CONFIG_FILE_FORMS, CONFIGS
from probe.modes.registry import MODES
from probe.rundir.mode_files import _READERS

TOY = Path(__file__).parent / "toy_mode"

# What a mode's package may import of probe: the pieces every mode shares (what a mode is, its
# config, the registry), the writer and reader halves of a run directory, what the tracer hands
# an op observer, and the vocabulary.
MODE_SURFACE = ("probe.errors", "probe.modes.base", "probe.modes.config", "probe.modes.registry",
                "probe.rundir.mode_files", "probe.rundir.writer", "probe.rundir.untrusted_reads",
                "probe.tracer.op_call", "probe.vocabulary")


@pytest.fixture
def toy() -> Iterator[ModuleType]:
    """The toy package, imported (so registered) for one test and taken out of the registries after."""
    package = importlib.import_module("toy_mode")
    yield package
    for registry in (MODES, CONFIGS, _READERS):
        registry.pop("toy", None)
    CONFIG_FILE_FORMS[:] = [f for f in CONFIG_FILE_FORMS if not f.options.__module__.startswith("toy_mode")]
    for name in [m for m in sys.modules if m == "toy_mode" or m.startswith("toy_mode.")]:
        del sys.modules[name]


def test_a_toy_mode_writes_its_file_and_reads_it_back_through_probe_load(tmp_path, toy):
    train_in(probe.mode([toy.Toy(), "stats"], out=tmp_path / "r"), steps=2)
    run = probe.load(tmp_path / "r")
    reader = run.mode("toy")
    assert isinstance(reader, toy.ToyReader)
    counts = reader.counts()
    assert [(c.step, c.rank) for c in counts] == [(0, 0), (1, 0)]
    for c in counts:  # what the toy counted is what the tracer recorded, phase by phase
        assert c.by_phase == dict(Counter(op.phase for op in run.ops(c.step)))
        assert c.by_phase["forward"] >= 3 and c.by_phase["backward"] >= 1
    assert run.damaged_steps() == []  # read whole through its reader's read_whole


def test_another_tools_config_file_form_the_toy_registers_is_read_by_config(tmp_path, toy):
    session = probe.mode(config={"op_counter": {"forward_only": True}}, out=tmp_path / "r")
    assert [m.name for m in session.modes] == ["toy"] and session.modes[0].config.phases == "forward"
    train_in(session, steps=1)
    (counts,) = probe.load(tmp_path / "r").mode("toy").counts()
    assert set(counts.by_phase) == {"forward"}
    with pytest.raises(probe.ProbeError, match="op_counter: expected"):
        probe.mode(config={"op_counter": {"forward_only": "yes"}}, out=tmp_path / "bad")


def test_the_toy_mode_imports_only_what_every_mode_may_read(toy):
    known = set(probe_modules())
    found = {target for path in sorted(TOY.glob("*.py"))
             for target in imports_of(f"toy_mode.{path.stem}", path, known)}
    assert found and all(any(t == s or t.startswith(s + ".") for s in MODE_SURFACE) for t in found), found
