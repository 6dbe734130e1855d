"""The mode registry: names are unique; registering the same class again is harmless."""

from __future__ import annotations

import pytest

import probe
from probe.modes import MODES, Mode, register_mode
from probe.modes.stats.mode import StatsMode


def test_a_different_class_under_a_taken_name_is_refused() -> None:
    class Impostor(Mode):
        name = "stats"

    with pytest.raises(probe.ProbeError, match=r"'stats' is taken by probe\.modes\.stats\.mode\.StatsMode"):
        register_mode(Impostor)
    assert MODES["stats"] is StatsMode


def test_registering_the_same_class_again_is_allowed() -> None:
    assert register_mode(StatsMode) is StatsMode
    assert MODES["stats"] is StatsMode


def test_a_class_without_a_name_is_refused() -> None:
    class Nameless(Mode):
        pass

    with pytest.raises(probe.ProbeError, match="no 'name'"):
        register_mode(Nameless)
