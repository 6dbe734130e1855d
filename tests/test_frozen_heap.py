"""While the probe traces, the program's objects are out of Python's garbage collections
(``probe.tracer.frozen_heap``): full collections walk only what was made since."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

import probe
from probe.tracer.frozen_heap import frozen_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


@pytest.fixture(autouse=True)
def _nothing_frozen_around():
    assert gc.get_freeze_count() == 0
    yield
    assert gc.get_freeze_count() == 0, "a test left the heap frozen"


def test_a_traced_session_freezes_the_heap_and_gives_it_back(tmp_path):
    before = _Node()
    with probe.mode("stats", out=tmp_path / "r") as session:
        assert gc.get_freeze_count() > 0
        made_inside = _Node()
        torch.ones(4) * 2
        gc.collect()
        assert not _tracked_in_a_generation(before)  # frozen: no collection walks it
        assert _tracked_in_a_generation(made_inside)
        session.step()
    assert _tracked_in_a_generation(before)
    assert gc.get_freeze_count() == 0
    assert _recorded_options(tmp_path / "r")["gc_freeze"] is True


def test_garbage_made_before_tracing_is_freed_after_it(tmp_path):
    node = _Node()
    gone = weakref.ref(node)
    with probe.mode("structure", out=tmp_path / "r"):
        del node
        gc.collect()
        assert gone() is not None  # held back while tracing (docs/architecture.md says so)
    gc.collect()
    assert gone() is None


def test_gc_freeze_false_and_the_programs_own_choices_are_left_alone(tmp_path):
    with probe.mode("structure", out=tmp_path / "off", gc_freeze=False):
        assert gc.get_freeze_count() == 0
    assert _recorded_options(tmp_path / "off")["gc_freeze"] is False
    gc.disable()
    try:
        with probe.mode("structure", out=tmp_path / "disabled"):
            assert gc.get_freeze_count() == 0  # the program turned the collector off
    finally:
        gc.enable()
    # (Not by counts: a frozen object freed by its last reference leaves the permanent generation.)
    mine = _Node()
    gc.freeze()  # the program froze its own objects: its freeze stands, and only it undoes it
    try:
        made_after = _Node()
        with probe.mode("structure", out=tmp_path / "own"):
            assert _tracked_in_a_generation(made_after)  # the probe froze nothing more
        assert not _tracked_in_a_generation(mine)  # nor undid the program's freeze
    finally:
        gc.unfreeze()


def test_nested_tracing_shares_one_freeze_until_the_last_leaves():
    marker = _Node()
    with frozen_heap():
        assert not _tracked_in_a_generation(marker)
        with frozen_heap():
            assert not _tracked_in_a_generation(marker)
        assert not _tracked_in_a_generation(marker)  # the outer one still holds it
    assert _tracked_in_a_generation(marker)
    assert gc.get_freeze_count() == 0


def test_an_interrupted_session_gives_the_heap_back(tmp_path):
    with pytest.raises(KeyboardInterrupt), probe.mode("stats", out=tmp_path / "r"):
        torch.ones(3) + 1
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0


def _recorded_options(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["options"]


def _tracked_in_a_generation(obj: object) -> bool:
    return any(o is obj for generation in range(3) for o in gc.get_objects(generation))
