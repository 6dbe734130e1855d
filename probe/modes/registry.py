"""Mode names -> classes. A mode registers itself by name; the session looks it up."""

from __future__ import annotations

from probe.modes.base import Mode

MODES: dict[str, type[Mode]] = {}


def register_mode(cls: type[Mode]) -> type[Mode]:
    MODES[cls.name] = cls
    return cls


def mode_option_names() -> dict[str, set[str]]:
    return {name: set(cls.option_names) for name, cls in MODES.items()}
