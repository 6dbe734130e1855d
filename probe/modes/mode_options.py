"""Modes as objects that carry their own options.

``probe.mode([probe.Stats(inputs=True), probe.Monitor(targets=["layers.*"])], out=...)`` says
which options belong to which mode; ``probe.mode(["stats", "monitor"], inputs=True, ...)``,
the flat form, stays accepted and means the same. Each mode's subpackage defines its subclass
(``probe.modes.stats.options``, ...)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from probe.errors import ProbeError
from probe.modes.registry import mode_option_names


class ModeOptions:
    """One mode and the options given for it, as ``probe.mode([...])`` takes it. Each mode's
    subpackage defines its own subclass (``probe.modes.stats.Stats``, ...) and names the mode
    (:attr:`mode`). An option the mode does not take is refused when the object is made; the values
    are checked by ``probe.mode``, by the same validator as in the flat form."""

    mode: ClassVar[str]
    """The registered name of the mode (``"stats"``, ``"monitor"``, ...)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "mode" in cls.__dict__:
            _CLASSES[cls.mode] = cls

    def __init__(self, **options: Any) -> None:
        accepted = mode_option_names().get(self.mode)
        if accepted is None:
            raise ProbeError(f"{type(self).__name__}: mode {self.mode!r} is not registered")
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ProbeError(f"{type(self).__name__}: unknown option(s) {unknown} for mode {self.mode!r}; "
                             f"accepted: {sorted(accepted)}")
        self._options = MappingProxyType(dict(options))

    @property
    def options(self) -> Mapping[str, Any]:
        """The options given for this mode (read-only)."""
        return self._options

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and _same_options(self._options, other._options)  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # options may hold unhashable values

    def __repr__(self) -> str:
        inner = ", ".join(f"{key}={value!r}" for key, value in self._options.items())
        return f"{type(self).__name__}({inner})"


_CLASSES: dict[str, type[ModeOptions]] = {}
"""Mode name -> its options class, filled as each mode's subpackage defines it."""


def as_mode_objects(names: Sequence[str], options: Mapping[str, Any]) -> tuple[list[ModeOptions | str],
                                                                             dict[str, Any]]:
    """The modes ``names`` as objects, each carrying the options of ``options`` its mode takes, and the
    options no selected mode takes (the session's common ones; an unknown one is refused later, by
    ``probe.mode``). What the config adapters (msprobe's ``config.json`` and monitor config) build:
    each option reaches ``probe.mode`` as the property of one mode. A mode without an options class
    (or an unknown name, refused by ``probe.mode``) stays a name."""
    accepted = mode_option_names()
    objects: list[ModeOptions | str] = []
    claimed: set[str] = set()
    for name in names:
        cls = _CLASSES.get(name)
        if cls is None:
            objects.append(name)
            continue
        own = {key: value for key, value in options.items() if key in accepted.get(name, ())}
        claimed |= own.keys()
        objects.append(cls(**own))
    return objects, {key: value for key, value in options.items() if key not in claimed}


def same_value(a: Any, b: Any) -> bool:
    """Whether two option values are the same value (a tensor is only the same as itself)."""
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # a tensor, or a value whose == is not a truth value
        return False


def _same_options(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
