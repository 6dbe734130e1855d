"""A mode's config: one kw-only dataclass per registered mode (``probe.Stats``, ``probe.Monitor``, ...).

Each field is one option of the mode, declared once by
:func:`~probe.vocabulary.option_fields.option`: its type, its default, its check (choices, ranges)
and its doc. Making a config validates every given field by its check, then the rules between
fields (:meth:`ModeConfig.validate`); a bad value is a ``ProbeError`` naming the option. Configs are
namespaced per mode: ``probe.Stats(distribution=True)`` beside ``probe.Monitor(distribution=False)``
gives each mode its own value.

The other ways of saying options are adapters that build configs: ``probe.mode``'s keyword options
and mode names (``"stats"``, ``["stats", "dump"]``, ``"stats+dump"``; :func:`configs_for`), a JSON
config file, and msprobe's config files (``probe.msprobe_config``, ``probe.modes.monitor.config``).
The option table in ``docs/options.md`` is generated from the fields (``probe/option_docs.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from probe.errors import ProbeError
from probe.vocabulary.option_fields import check_given, option_specs
from probe.vocabulary.option_values import same_value

CONFIGS: dict[str, type[ModeConfig]] = {}
"""Mode name -> its config class, filled as each mode's subpackage defines it."""


@dataclass(frozen=True)
class ConfigFileForm:
    """Another tool's config file that a mode reads as ``probe.mode`` options (msprobe's monitor
    ``config.json``), registered by the mode so that ``config=`` reads it without naming the mode."""

    recognises: Callable[[Mapping[str, Any]], bool]
    """Whether a config file's contents are in this form."""
    options: Callable[[Mapping[str, Any]], dict[str, Any]]
    """The ``probe.mode`` options it stands for (a ``ProbeError`` for what cannot be honoured)."""


CONFIG_FILE_FORMS: list[ConfigFileForm] = []
"""The forms the modes registered, in the order they did."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ModeConfig:
    """The options of one mode, as ``probe.mode([...])`` takes them. A subclass names its mode
    (:attr:`mode`) and declares its options as fields; an option it does not declare is refused
    when the config is made, and so is a bad value."""

    mode: ClassVar[str]
    """The registered name of the mode (``"stats"``, ``"monitor"``, ...)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Set before @dataclass runs on the subclass, which then keeps them: a config shows the
        # options given, and compares by the values in force.
        cls.__repr__ = ModeConfig.__repr__  # type: ignore[method-assign]
        cls.__eq__ = ModeConfig.__eq__  # type: ignore[method-assign]
        cls.__hash__ = None  # type: ignore[assignment]
        if "mode" in cls.__dict__:
            CONFIGS[cls.mode] = cls

    def __new__(cls, *args: Any, **options: Any) -> ModeConfig:
        if args:
            raise ProbeError(f"{cls.__name__} takes its options by name ({cls.__name__}(option=value)), "
                             f"got {len(args)} positional argument(s)")
        accepted = cls.option_names()
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ProbeError(f"{cls.__name__}: unknown option(s) {unknown} for mode {cls.mode!r}; "
                             f"accepted: {sorted(accepted)}")
        config = super().__new__(cls)
        object.__setattr__(config, "_given", MappingProxyType(dict(options)))
        return config

    def __post_init__(self) -> None:
        check_given(self, self._given)
        self.validate()

    def validate(self) -> None:
        """Rules between options, after each is checked on its own; raise ``ProbeError``."""

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The names of this mode's options."""
        return frozenset(option_specs(cls))

    @property
    def options(self) -> Mapping[str, Any]:
        """The options given (not defaulted), as given (read-only): what a summary records."""
        return self._given

    def with_options(self, **more: Any) -> ModeConfig:
        """A config of the same mode with ``more`` options given besides (validated anew)."""
        return type(self)(**{**self._given, **more})

    def completed(self, common: Any) -> ModeConfig:
        """This config with what the session's common options imply for it (``common``: the
        validated :class:`~probe.vocabulary.session_options.Options`). Itself by default."""
        return self

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(same_value(getattr(self, name), getattr(other, name)) for name in option_specs(self))

    __hash__ = None  # type: ignore[assignment]  # options may hold unhashable values

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}={value!r}" for key, value in self._given.items())
        return f"{type(self).__name__}({inner})"


def configs_for(names: Sequence[str], options: Mapping[str, Any]) -> tuple[list[ModeConfig | str],
                                                                           dict[str, Any]]:
    """The flat keyword form as configs: each mode of ``names`` made with the options of ``options``
    it declares (an option two modes declare goes to both), and the options no named mode declares
    (the session's common ones; an unknown one is refused by ``probe.mode``). An unknown name stays
    a name (``probe.mode`` refuses it). What the config adapters build."""
    configs: list[ModeConfig | str] = []
    claimed: set[str] = set()
    for name in names:
        cls = CONFIGS.get(name) if isinstance(name, str) else None
        if cls is None:
            configs.append(name)
            continue
        own = {key: value for key, value in options.items() if key in cls.option_names()}
        claimed |= own.keys()
        configs.append(cls(**own))
    return configs, {key: value for key, value in options.items() if key not in claimed}

