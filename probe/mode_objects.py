"""Modes as objects that carry their own options.

``probe.mode([probe.Stats(inputs=True), probe.Monitor(targets=["layers.*"])], out=...)`` says
which options belong to which mode; ``probe.mode(["stats", "monitor"], inputs=True, ...)``,
the flat form, stays accepted and means the same. An object refuses, when it is made, an
option its mode does not take (naming the mode and what it accepts); the values are checked
by ``probe.mode``, by the same validator as in the flat form, so a value is judged one way
whichever form carried it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from probe.errors import ProbeError
from probe.vocabulary.option_values import show


class ModeOptions:
    """One mode and the options given for it. Subclasses name the mode (:attr:`mode`)."""

    mode: ClassVar[str]
    """The registered name of the mode (``"stats"``, ``"monitor"``, ...)."""

    def __init__(self, **options: Any) -> None:
        from probe.modes.registry import mode_option_names

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


class Stats(ModeOptions):
    """Statistics of every op's outputs (and its inputs from outside the step)."""

    mode = "stats"


class Structure(ModeOptions):
    """The op records alone: ids, modules, phases, dtypes, shapes and the op graph."""

    mode = "structure"


class Dump(ModeOptions):
    """The tensors themselves, to safetensors shards, with the calls that made them."""

    mode = "dump"


class FreeBenchmark(ModeOptions):
    """Each op re-run perturbed: fragile ops found without a reference run."""

    mode = "free_benchmark"


class Upcast(ModeOptions):
    """Modules computed in higher precision, carried across their ops."""

    mode = "upcast"


class Monitor(ModeOptions):
    """Training-state statistics of chosen modules, from hooks, with anomaly alerts."""

    mode = "monitor"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # a tensor, or a value whose == is not a truth value
        return False


def _same_options(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def unfold(modes: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``probe.mode``'s ``modes`` and keyword options with mode objects unfolded into names and
    keyword options. An option given twice with different values (by two objects that share it,
    such as ``distribution`` for stats and monitor, or by an object and a keyword) is refused,
    naming both places: the session holds one value per option name."""
    if isinstance(modes, ModeOptions):
        modes = [modes]
    if not isinstance(modes, (list, tuple)) or not any(isinstance(m, ModeOptions) for m in modes):
        return modes, options
    names: list[Any] = []
    merged = dict(options)
    given_by: dict[str, str] = {key: "a keyword option" for key in options}
    for item in modes:
        if not isinstance(item, ModeOptions):
            names.append(item)  # a name (or a bad value: refused by the mode list's own check)
            continue
        names.append(item.mode)
        for key, value in item.options.items():
            if key in merged and not _same(merged[key], value):
                raise ProbeError(f"option {key!r} given twice with different values: {show(merged[key])} "
                                 f"by {given_by[key]} and {show(value)} by {item!r}")
            merged[key] = value
            given_by.setdefault(key, repr(item))
    return names, merged
