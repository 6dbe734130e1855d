"""The session's common options (``probe.mode(..., out=..., steps=...)``), declared once.

:class:`Options` is the validated record every layer reads (the tracer its selection, the session
its run directory and flags). Each common option is one field made by
:func:`~probe.vocabulary.option_fields.option`: its type, default, check and doc together;
``probe.options`` validates what a user gave by those checks, and the option table in the docs
(``docs/options.md``) is generated from the same fields. The modes' own options are their configs
(:mod:`probe.modes.config`), held here as :attr:`Options.mode_configs`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.hparams import parse_hparams
from probe.vocabulary.option_fields import Check, boolean, choice, option, option_specs
from probe.vocabulary.option_values import (
    COMPILED_POLICIES,
    DEFAULT_CHECKSUMS,
    PHASES,
    IntSet,
    Patterns,
    _str_list,
    parse_checksums,
    same_value,
    show,
)


def option_path(option_name: str, value: Any) -> Path:
    """A filesystem path given as a ``str`` or ``os.PathLike`` (bytes paths are refused)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ProbeError(f"option {option_name!r}: expected a path (str or pathlib.Path), got {show(value)}")
    if not text or "\0" in text:
        raise ProbeError(f"option {option_name!r}: {show(text)} is not a usable path")
    return Path(text)


def _out(option_name: str, value: Any) -> Path | None:
    if value is None:
        return None
    out = option_path(option_name, value)
    try:
        dangling = out.is_symlink() and not out.exists()  # a name too long for the filesystem fails here
    except OSError as e:
        raise ProbeError(f"option 'out': {show(str(out))} is not a usable path: {e.strerror}") from None
    if dangling:
        raise ProbeError(f"option 'out': {show(str(out))} is a symbolic link to nothing "
                         f"({show(os.readlink(out))}); remove it or point it at a directory")
    return out


def _model(option_name: str, value: Any) -> Any:
    if value is None or isinstance(value, torch.nn.Module):
        return value
    if isinstance(value, dict) and value and all(
        isinstance(k, str) and isinstance(v, torch.nn.Module) for k, v in value.items()
    ):
        return value
    raise ProbeError(
        "option 'model': expected an nn.Module or a non-empty dict of name -> nn.Module, "
        f"got {show(value)}"
    )


def _phases(option_name: str, value: Any) -> frozenset[str]:
    phases = frozenset(_str_list("phases", value, f"a phase from {list(PHASES)}"))
    bad = sorted(p for p in phases if p not in PHASES)
    if bad or not phases:
        raise ProbeError(f"option 'phases': {bad or show(value)} not a non-empty subset of {list(PHASES)}")
    return phases


_GLOBS = Check(Patterns.parse, "a glob or a list of globs; `None`: all")
_INTS = Check(IntSet.parse, "an int, `'0,4-6'`, a `range`, or a list of those; `None`: all")


@dataclass
class Options:
    """Validated session options; see API.md for their meaning. The fields made by ``option`` are
    the common options; :attr:`modes` and :attr:`mode_configs` are what the modes were given."""

    modes: tuple[str, ...]
    """The selected modes' registered names, in the order given."""
    out: Path | None = option(None, check=Check(_out, "a path; `None`: `probe_runs/run-<time>-<pid>`"),
                              doc="run directory; created; refused when not empty unless `overwrite=True`")
    overwrite: bool = option(False, check=boolean(), doc="write into a non-empty `out`")
    model: Any = option(None, check=Check(_model, "an `nn.Module`, a dict name -> module, `None`"),
                        doc="the root module that names modules (default: the outermost one called); "
                            "with it, checksums of weights, inputs and RNG")
    ops: Patterns = option(default_factory=lambda: Patterns(None), check=_GLOBS,
                           doc="op names to record (`aten.mm.default` or `mm`)")
    modules: Patterns = option(default_factory=lambda: Patterns(None), check=_GLOBS,
                               doc="module FQNs to record (the monitor's targets when `targets` is absent)")
    steps: IntSet = option(default_factory=lambda: IntSet(None), check=_INTS, doc="steps to record")
    ranks: IntSet = option(default_factory=lambda: IntSet(None), check=_INTS, doc="ranks that record")
    phases: frozenset[str] = option(frozenset(PHASES), check=Check(_phases, f"a subset of {list(PHASES)}"),
                                    doc="phases to record")
    stack: bool = option(False, check=boolean(), doc="record Python call sites")
    compiled: str = option("eager", check=choice(*COMPILED_POLICIES),
                           doc="compiled regions run eagerly and traced, or kept compiled")
    compiled_inputs: bool = option(False, check=boolean(),
                                   doc="with `compiled='keep'`: write each region call's inputs and outputs")
    """With ``compiled="keep"``: write each opened region call's inputs and compiled outputs (as
    the dump mode does), for judging the region against eager and fp64 and ``probe repro``."""
    async_flush: bool = option(True, check=boolean(), doc="write steps on a background thread")
    gc_freeze: bool = option(True, check=boolean(),
                             doc="leave the program's objects out of garbage collections while tracing")
    """Leave the program's objects out of garbage collections while tracing
    (``probe.tracer.frozen_heap``: the records' promotions made full collections walk them)."""
    hparams: dict[str, Any] | None = option(
        None, check=Check(lambda option_name, value: parse_hparams(value),
                          "a dict, `argparse.Namespace`, dataclass, object with `to_dict()`, `None`"),
        doc="hyperparameters recorded in `run.json`")
    checksums: frozenset[str] = option(
        DEFAULT_CHECKSUMS, check=Check(lambda option_name, value: parse_checksums(value),
                                       "`True`, `False`, or some of parameters, inputs, rng, "
                                       "parameters_each_step"),
        doc="with `model=`: what the checksums record")
    mode_configs: tuple[Any, ...] = ()
    """Each selected mode's config (:class:`probe.modes.config.ModeConfig`), in :attr:`modes` order."""

    @property
    def mode_options(self) -> Mapping[str, Any]:
        """The options given to the modes, as the flat keyword form spells them (an option two modes
        were given different values of is under each mode's name instead: ``"stats.distribution"``)."""
        flat: dict[str, Any] = {}
        by_key: dict[str, list[tuple[str, Any]]] = {}
        for config in self.mode_configs:
            for key, value in config.options.items():
                by_key.setdefault(key, []).append((config.mode, value))
        for key, values in by_key.items():
            first = values[0][1]
            if all(same_value(first, value) for _, value in values[1:]):
                flat[key] = first
            else:
                flat.update({f"{mode}.{key}": value for mode, value in values})
        return flat


COMMON_OPTIONS = frozenset(option_specs(Options))
"""The names of the common options (``config`` aside: it names a file of options)."""
