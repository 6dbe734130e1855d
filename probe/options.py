"""Validated options of a probe session.

Everything a user can pass to ``probe.mode(...)`` (or put in a JSON config file)
is checked here, once, before any op is traced. Each bad value raises
:class:`ProbeError` naming the option, the value and what is accepted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.modes.config import CONFIG_FILE_FORMS, CONFIGS, ModeConfig
from probe.rundir import layout
from probe.tracer.rank import current_rank, world_size
from probe.vocabulary.option_fields import option_specs
from probe.vocabulary.option_values import (  # noqa: F401  (re-exported: imported from here too)
    CHECKSUM_KINDS,
    COMPILED_POLICIES,
    DEFAULT_CHECKSUMS,
    PHASES,
    IntSet,
    Patterns,
    same_value,
    show,
)
from probe.vocabulary.session_options import COMMON_OPTIONS, Options, option_path

_COMMON_KEYS = COMMON_OPTIONS  # the name the option tests read
CONFIG_MAX_BYTES = 16 << 20  # a config is a few keys; more is a wrong path (a checkpoint, a dataset)


def parse_options(modes: Any, kwargs: dict[str, Any]) -> Options:
    """Validate ``probe.mode(modes, **kwargs)``: the common options by their fields
    (:class:`Options`), and each selected mode's config (:class:`~probe.modes.config.ModeConfig`).

    ``modes`` is a mode name, ``"a+b"``, a list of names, or configs (``probe.Stats(...)``), mixed
    freely; a flat keyword option goes to every selected mode that declares it, and one no selected
    mode declares (and that is no common option) is an error. Options given directly win over the
    same keys of ``config``; a config object's own option and a keyword with another value for it
    are refused, naming both.
    """
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    if modes is None:
        modes = kwargs.pop("mode", None)
    kwargs.pop("mode", None)
    from_config: dict[str, Any] = {}
    config_objects: dict[str, ModeConfig] = {}
    if config is not None:
        from_config = _config_options(config)
        config_modes = from_config.pop("mode", None)
        if modes is None and config_modes is not None:  # its configs stay the config's: keywords win
            modes = [m.mode if isinstance(m, ModeConfig) else m for m in _as_list(config_modes)]
        # A config's mode objects (the msprobe adapters build them): the options of a mode that is
        # also selected directly apply to it; the others count as the config's own keys.
        for item in _as_list(config_modes):
            if isinstance(item, ModeConfig):
                config_objects[item.mode] = item
    names, objects = _parse_modes(modes)
    for name, item in config_objects.items():
        if name not in names:
            for key, value in item.options.items():
                from_config.setdefault(key, value)

    opts = Options(modes=names)
    specs = option_specs(Options)
    for key in specs:
        if key in kwargs or key in from_config:
            from_file = from_config.pop(key, None)
            value = kwargs.pop(key) if key in kwargs else from_file  # given directly wins
            setattr(opts, key, specs[key][1].check.parse(key, value))

    flat = {**from_config, **kwargs}  # what is left: the modes' options in the flat form
    accepted = set().union(*(CONFIGS[name].option_names() for name in names))
    for key in flat:
        if key not in accepted:
            known = sorted(COMMON_OPTIONS | {"config"} | accepted)
            raise ProbeError(f"unknown option {show(key)} for mode(s) {list(names)}; "
                             f"accepted options: {known}")
    configs = []
    for name in names:
        cls = CONFIGS[name]
        given = {key: value for key, value in flat.items() if key in cls.option_names()}
        if name in config_objects:
            given = {**config_objects[name].options, **given}
        own = objects.get(name)
        if own is None:
            made = cls(**given)
        else:
            for key, value in own.options.items():
                if key in kwargs and not same_value(kwargs[key], value):
                    raise ProbeError(f"option {key!r} given twice with different values: {show(kwargs[key])} "
                                     f"by a keyword option and {show(value)} by {own!r}")
            extra = {key: value for key, value in given.items() if key not in own.options}
            made = own.with_options(**extra) if extra else own
        configs.append(made.completed(opts))
    opts.mode_configs = tuple(configs)
    rank = current_rank()
    if opts.out is not None and rank in opts.ranks:
        check_out_dir(opts.out, opts.overwrite, rank, world_size())
    return opts


def _as_list(modes: Any) -> list[Any]:
    if isinstance(modes, (list, tuple)):
        return list(modes)
    return [] if modes is None else [modes]


def _parse_modes(modes: Any) -> tuple[tuple[str, ...], dict[str, ModeConfig]]:
    """The selected modes' names, and the configs given as objects by name. A name may be
    ``"stats+dump"``: the modes it joins."""
    known = sorted(CONFIGS)
    if modes is None:
        raise ProbeError(f"no mode given; accepted modes: {known}")
    items = modes if isinstance(modes, (list, tuple)) else [modes]
    names: list[str] = []
    objects: dict[str, ModeConfig] = {}
    for item in items:
        if isinstance(item, ModeConfig):
            names.append(item.mode)
            objects.setdefault(item.mode, item)
        elif isinstance(item, str):
            names += item.split("+") if "+" in item else [item]
        else:
            raise ProbeError(f"modes: expected a mode name, a config such as probe.Stats(), or a list of "
                             f"them from {known}, got {show(modes)}")
    if not names:
        raise ProbeError(f"no mode given; accepted modes: {known}")
    for name in names:
        if name not in CONFIGS:
            raise ProbeError(f"unknown mode {show(name)}; accepted modes: {known}")
    if len(set(names)) != len(names):
        raise ProbeError(f"mode list {names!r} names a mode twice")
    return tuple(names), objects


def _config_options(config: Any) -> dict[str, Any]:
    """``config=``: a JSON file (or a dict) of options, or of msprobe's config or monitor config."""
    from probe.msprobe_config import from_msprobe, is_msprobe_config

    data = _read_config(config)
    bad_keys = [key for key in data if not isinstance(key, str)]
    if bad_keys:
        raise ProbeError(f"option 'config': keys must be option names (strings), got {show(bad_keys)}")
    if "config" in data:
        raise ProbeError(f"option 'config': a config names another config ({show(data['config'])}); "
                         "configs do not nest: merge the two into one file")
    if is_msprobe_config(data):
        return from_msprobe(data)
    for form in CONFIG_FILE_FORMS:  # registered by the modes (importing probe.modes.config imports them)
        if form.recognises(data):
            return form.options(data)
    return data


def _no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (write a number)")


def _read_config(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ProbeError(f"option 'config': expected a path to a JSON file or a dict, got {show(config)}")
    path = option_path("config", config)
    where = show(str(path))
    try:
        size = path.stat().st_size
        if size > CONFIG_MAX_BYTES:
            raise ProbeError(f"option 'config': {where} holds {size} bytes; a config file is at most "
                             f"{CONFIG_MAX_BYTES} (is it the right file?)")
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_json_constant)
    except FileNotFoundError:
        raise ProbeError(f"option 'config': file {where} does not exist") from None
    except UnicodeDecodeError as e:
        raise ProbeError(f"option 'config': {where} is not UTF-8 text ({e.reason} at byte {e.start})"
                         ) from None
    except RecursionError:
        raise ProbeError(f"option 'config': {where} nests too deeply to be a config") from None
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        raise ProbeError(f"option 'config': cannot read {where}: {e}") from None
    if not isinstance(data, dict):
        raise ProbeError(f"option 'config': {where} must hold a JSON object, not {type(data).__name__}")
    return data


def check_out_dir(out: Path, overwrite: bool, rank: int = 0, world: int = 1) -> None:
    """Refuse an output location we could not (or should not) write.

    In a job of several processes the other ranks write their own ``rankN``
    directories (and ``run.json``) into the same place, possibly first: only this
    rank's directory, or anything that is not a probe entry, makes it "not empty".
    """
    if out.exists():
        if not out.is_dir():
            raise ProbeError(f"option 'out': {str(out)!r} exists and is not a directory")
        entries = [entry.name for entry in out.iterdir()]
        if world > 1:
            mine = layout.rank_dir(out, rank).name
            entries = [e for e in entries if e == mine or not layout.is_probe_entry(e)]
        if entries and not overwrite:
            what = "is not empty" if world == 1 else f"already holds {sorted(entries)[:3]}"
            raise ProbeError(
                f"option 'out': {str(out)!r} {what}; choose an empty directory or pass overwrite=True"
            )
        if not os.access(out, os.W_OK | os.X_OK):
            raise ProbeError(f"option 'out': {str(out)!r} is not writable")
        return
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ProbeError(f"option 'out': cannot create {str(out)!r}: {str(parent)!r} is not writable")

