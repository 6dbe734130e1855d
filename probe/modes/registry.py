"""Mode names -> plug-in classes. A mode registers itself by name, with its config class; the
session looks it up, and the run reader finds the mode's file reader (registered with it into
:mod:`probe.rundir.mode_files`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from probe.errors import ProbeError
from probe.modes.base import SessionPlugin
from probe.modes.config import ModeConfig
from probe.rundir.mode_files import register_mode_files

MODES: dict[str, type[SessionPlugin]] = {}

RUN_COMMANDS: dict[str, Callable[..., Any]] = {}
"""``probe`` subcommand -> what a mode does with a written run it is handed (``"plan"``: the
recipes' ranking writes a plan file). Registered by the mode, so the CLI runs it by name without
importing the mode's package."""


def _same_class(a: type, b: type) -> bool:
    # A module imported twice (importlib.reload, a test re-import) defines the class anew.
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def register_mode(cls: type[SessionPlugin]) -> type[SessionPlugin]:
    """Register ``cls`` under ``cls.name``; a different class under a taken name is an error."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ProbeError(f"mode class {cls.__qualname__} has no 'name' to register it under")
    taken = MODES.get(name)
    if taken is not None and not _same_class(taken, cls):
        raise ProbeError(
            f"mode name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
            f"register {cls.__module__}.{cls.__qualname__} under another name"
        )
    config = getattr(cls, "config_class", None)
    if config is None:  # a mode without options of its own: its config has no fields
        config = dataclasses.make_dataclass(f"{cls.__name__}Config", [], bases=(ModeConfig,),
                                            namespace={"mode": name}, frozen=True, kw_only=True, eq=False)
        cls.config_class = config
    if getattr(config, "mode", None) != name:
        raise ProbeError(f"mode class {cls.__qualname__}: its config_class {config.__qualname__} is not the "
                         f"config of mode {name!r} (a ModeConfig subclass with mode = {name!r})")
    cls.option_names = config.option_names()  # declared once, by the config's fields
    MODES[name] = cls
    register_mode_files(name, cls.files)
    return cls

