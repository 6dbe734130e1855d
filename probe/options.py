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

import torch

from probe.errors import ProbeError
from probe.hparams import parse_hparams
from probe.modes.mode_options import ModeOptions, same_value
from probe.modes.registry import MODES
from probe.rundir import layout
from probe.tracer.rank import current_rank, world_size
from probe.vocabulary.option_values import (  # noqa: F401  (re-exported: imported from here too)
    CHECKSUM_KINDS,
    COMPILED_POLICIES,
    DEFAULT_CHECKSUMS,
    PHASES,
    IntSet,
    Options,
    Patterns,
    _str_list,
    host_memory_bytes,
    parse_bool,
    parse_checksums,
    parse_choice,
    parse_int,
    parse_number,
    show,
)

_COMMON_KEYS = {
    "out", "overwrite", "model", "ops", "modules", "steps", "ranks", "phases", "stack", "compiled",
    "async_flush", "hparams", "checksums", "compiled_inputs", "gc_freeze",
}
CONFIG_MAX_BYTES = 16 << 20  # a config is a few keys; more is a wrong path (a checkpoint, a dataset)


def parse_options(modes: Any, kwargs: dict[str, Any], mode_option_names: dict[str, set[str]]) -> Options:
    """Validate ``probe.mode(modes, **kwargs)``.

    ``mode_option_names`` maps each known mode name to the option names it accepts;
    an option no selected mode accepts is an error. Options given directly win
    over the same keys of ``config``.
    """
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    modes, kwargs = unfold(modes, kwargs)  # an object's options count as given directly
    if config is not None:
        from_config = _config_options(config)
        # A config's mode objects (the msprobe adapters build them) unfold as the config's own keys.
        config_modes, from_config = unfold(from_config.pop("mode", None), from_config)
        if config_modes is not None:
            from_config["mode"] = config_modes
        for key, value in from_config.items():
            kwargs.setdefault(key, value)
    if modes is None:
        modes = kwargs.pop("mode", None)
    kwargs.pop("mode", None)

    mode_names = _parse_modes(modes, mode_option_names)
    opts = Options(modes=mode_names)

    for key in list(kwargs):
        if key not in _COMMON_KEYS:
            continue
        value = kwargs.pop(key)
        if key == "out":
            opts.out = _parse_out(value)
        elif key == "model":
            opts.model = _parse_model(value)
        elif key in ("ops", "modules"):
            setattr(opts, key, Patterns.parse(key, value))
        elif key in ("steps", "ranks"):
            setattr(opts, key, IntSet.parse(key, value))
        elif key == "phases":
            opts.phases = _parse_phases(value)
        elif key in ("overwrite", "stack", "async_flush", "compiled_inputs", "gc_freeze"):
            setattr(opts, key, parse_bool(key, value))
        elif key == "compiled":
            opts.compiled = parse_choice(key, value, COMPILED_POLICIES)
        elif key == "hparams":
            opts.hparams = parse_hparams(value)
        elif key == "checksums":
            opts.checksums = parse_checksums(value)

    for name in mode_names:  # what each mode makes of the common options (the monitor: targets)
        implied = MODES[name].implied_options(opts, kwargs) if name in MODES else {}
        for key, value in implied.items():
            kwargs.setdefault(key, value)
    accepted = set().union(*(mode_option_names[m] for m in mode_names))
    for key in kwargs:
        if key not in accepted:
            known = sorted(_COMMON_KEYS | {"config"} | accepted)
            raise ProbeError(
                f"unknown option {show(key)} for mode(s) {list(mode_names)}; accepted options: {known}"
            )
    opts.mode_options = kwargs
    rank = current_rank()
    if opts.out is not None and rank in opts.ranks:
        check_out_dir(opts.out, opts.overwrite, rank, world_size())
    return opts


def _parse_modes(modes: Any, known: dict[str, set[str]]) -> tuple[str, ...]:
    if modes is None:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    if isinstance(modes, str):
        names = [modes]
    elif isinstance(modes, (list, tuple)) and all(isinstance(name, str) for name in modes):
        names = list(modes)
    else:
        raise ProbeError(f"modes: expected a mode name or a list of them from {sorted(known)}, "
                         f"got {show(modes)}")
    if not names:
        raise ProbeError(f"no mode given; accepted modes: {sorted(known)}")
    for name in names:
        if name not in known:
            raise ProbeError(f"unknown mode {show(name)}; accepted modes: {sorted(known)}")
    if len(set(names)) != len(names):
        raise ProbeError(f"mode list {names!r} names a mode twice")
    return tuple(names)


def _path(option: str, value: Any) -> Path:
    """A filesystem path given as a ``str`` or ``os.PathLike`` (bytes paths are refused)."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ProbeError(f"option {option!r}: expected a path (str or pathlib.Path), got {show(value)}")
    if not text or "\0" in text:
        raise ProbeError(f"option {option!r}: {show(text)} is not a usable path")
    return Path(text)


def _parse_out(value: Any) -> Path | None:
    if value is None:
        return None
    out = _path("out", value)
    try:
        dangling = out.is_symlink() and not out.exists()  # a name too long for the filesystem fails here
    except OSError as e:
        raise ProbeError(f"option 'out': {show(str(out))} is not a usable path: {e.strerror}") from None
    if dangling:
        raise ProbeError(f"option 'out': {show(str(out))} is a symbolic link to nothing "
                         f"({show(os.readlink(out))}); remove it or point it at a directory")
    return out


def _parse_model(value: Any) -> Any:
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


def _parse_phases(value: Any) -> frozenset[str]:
    phases = frozenset(_str_list("phases", value, f"a phase from {list(PHASES)}"))
    bad = sorted(p for p in phases if p not in PHASES)
    if bad or not phases:
        raise ProbeError(f"option 'phases': {bad or show(value)} not a non-empty subset of {list(PHASES)}")
    return phases


def _config_options(config: Any) -> dict[str, Any]:
    """``config=``: a JSON file (or a dict) of options, or of msprobe's config or monitor config."""
    from probe.modes.monitor.config import from_msprobe_monitor, is_monitor_config
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
    if is_monitor_config(data):
        return from_msprobe_monitor(data)
    return data


def _no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (write a number)")


def _read_config(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ProbeError(f"option 'config': expected a path to a JSON file or a dict, got {show(config)}")
    path = _path("config", config)
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
            if key in merged and not same_value(merged[key], value):
                raise ProbeError(f"option {key!r} given twice with different values: {show(merged[key])} "
                                 f"by {given_by[key]} and {show(value)} by {item!r}")
            merged[key] = value
            given_by.setdefault(key, repr(item))
    return names, merged
