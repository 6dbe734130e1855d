"""Modes given as objects carrying their options (``probe.Stats(inputs=True)``): the same run as
the flat form, each option checked where it is given, and conflicting values refused."""

from __future__ import annotations

import pytest
from conftest import run_modes

import probe


def _input_stats(run, step):
    """(op id, input position) of every input with statistics in ``step``."""
    return {(op.id, i) for op in run.ops(step=step) for i, t in enumerate(op.inputs) if t.stats is not None}


def test_objects_record_the_same_run_as_the_flat_form(tmp_path):
    flat = run_modes(tmp_path / "flat", ["stats", "dump"], inputs=True, tensors="outputs")
    objects = run_modes(tmp_path / "objects", [probe.Stats(inputs=True), probe.Dump(tensors="outputs")])
    assert objects.options.modes == flat.options.modes == ("stats", "dump")
    assert objects.options.mode_options == flat.options.mode_options
    a, b = probe.load(tmp_path / "flat"), probe.load(tmp_path / "objects")
    for step in (0, 1):
        ops_a, ops_b = a.ops(step=step), b.ops(step=step)
        assert [op.id for op in ops_a] == [op.id for op in ops_b]
        # inputs=True is honoured: inputs computed in the step have statistics too, not only the
        # external ones the default records.
        computed = {(op.id, i) for op in ops_b for i, t in enumerate(op.inputs) if t.source is not None}
        assert computed and computed <= _input_stats(b, step)
        assert _input_stats(a, step) == _input_stats(b, step)
    assert probe.compare(tmp_path / "flat", tmp_path / "objects").conclusion.startswith("no divergence")


def test_an_object_alone_and_a_name_beside_objects_are_accepted(tmp_path):
    alone = run_modes(tmp_path / "alone", probe.Stats())
    assert alone.options.modes == ("stats",)
    mixed = run_modes(tmp_path / "mixed", ["structure", probe.Stats(inputs=False)])
    assert mixed.options.modes == ("structure", "stats")
    assert mixed.options.mode_options == {"inputs": False}
    # inputs=False is honoured: inputs from outside the step (weights, the batch) have no
    # statistics of their own, where the default records them.
    def external(run):
        return {(op.id, i) for op in run.ops(step=0) for i, t in enumerate(op.inputs)
                if t.source is None and t.stats is not None}
    assert external(probe.load(tmp_path / "alone"))
    assert not external(probe.load(tmp_path / "mixed"))


def test_an_option_the_mode_does_not_take_is_refused_where_it_is_given():
    with pytest.raises(probe.ProbeError, match=r"Stats: unknown option\(s\) \['targets'\] for mode 'stats'"):
        probe.Stats(targets=["layers.*"])
    with pytest.raises(probe.ProbeError, match=r"Dump: unknown option.*'perturb'.*accepted: .*'tensors'"):
        probe.Dump(perturb="add_noise")


def test_a_bad_value_is_refused_by_the_same_validator_as_the_flat_form(tmp_path):
    with pytest.raises(probe.ProbeError) as flat:
        probe.mode("stats", out=tmp_path / "a", inputs="sometimes")
    with pytest.raises(probe.ProbeError) as objects:
        probe.mode(probe.Stats(inputs="sometimes"), out=tmp_path / "b")
    assert "inputs" in str(objects.value)
    assert str(flat.value) == str(objects.value)


def test_an_option_given_twice_with_different_values_is_refused_naming_both(tmp_path):
    given_twice = r"option 'inputs' given twice .*keyword.*Stats\(inputs=False\)"
    with pytest.raises(probe.ProbeError, match=given_twice):
        probe.mode([probe.Stats(inputs=False)], out=tmp_path / "a", inputs=True)
    # The same value twice is no conflict.
    session = probe.mode([probe.Stats(inputs=False)], out=tmp_path / "c", inputs=False)
    assert session.options.mode_options == {"inputs": False}


def test_objects_compare_by_mode_and_options():
    assert probe.Stats(inputs=True) == probe.Stats(inputs=True)
    assert probe.Stats(inputs=True) != probe.Stats(inputs=False)
    assert probe.Stats() != probe.Structure()
    assert repr(probe.Monitor(targets=["layers.*"])) == "Monitor(targets=['layers.*'])"
    with pytest.raises(TypeError):
        probe.Stats(inputs=True).options["inputs"] = False  # read-only
