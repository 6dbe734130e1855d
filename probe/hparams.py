"""The ``hparams`` option: a run's hyperparameters, recorded in ``run.json`` as JSON.

``probe.mode(..., hparams=...)`` takes a dict (or an ``argparse.Namespace``, a dataclass
instance, an object with ``to_dict()`` such as transformers' ``TrainingArguments``); the
values are written as JSON: numbers, strings, booleans and None as they are, containers
as lists and objects, anything else as a short ``repr``. The copy is bounded
(:data:`MAX_DEPTH`, :data:`MAX_VALUES`, :data:`MAX_CHARS`) so that a huge or recursive
value cannot stall the session's start. ``probe compare`` lists the hyperparameters that
differ between two runs (``probe.analysis.run_identity``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from probe.errors import ProbeError
from probe.vocabulary.option_values import show

MAX_DEPTH = 8
MAX_VALUES = 10_000
MAX_CHARS = 1_000
_CUT = "..."


class _Budget:
    def __init__(self) -> None:
        self.left = MAX_VALUES


def _json_value(value: Any, depth: int, budget: _Budget) -> Any:
    budget.left -= 1
    if budget.left < 0:
        return _CUT
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no NaN or Infinity
    if isinstance(value, str):
        return value if len(value) <= MAX_CHARS else value[:MAX_CHARS] + _CUT
    if depth >= MAX_DEPTH:
        return _CUT
    if isinstance(value, Mapping):
        return {str(key)[:MAX_CHARS]: _json_value(item, depth + 1, budget)
                for key, item in list(value.items())[:MAX_VALUES]}
    if isinstance(value, (list, tuple)):
        return [_json_value(item, depth + 1, budget) for item in value[:MAX_VALUES]]
    if isinstance(value, (set, frozenset)):  # sorted: a set's order changes from process to process
        return sorted((_json_value(item, depth + 1, budget) for item in list(value)[:MAX_VALUES]), key=repr)
    return show(value)


def _as_mapping(value: Any) -> Mapping[Any, Any] | None:
    if isinstance(value, Mapping):
        return value
    if isinstance(value, argparse.Namespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        try:
            found = to_dict()
        except Exception as e:  # the user's object: its failure is named, not raised as is
            raise ProbeError(f"option 'hparams': {show(value)}.to_dict() failed: {type(e).__name__}: {e}"
                             ) from None
        return found if isinstance(found, Mapping) else None
    return None


def parse_hparams(value: Any) -> dict[str, Any] | None:
    """``hparams=``: the hyperparameters as a JSON object (None when not given)."""
    if value is None:
        return None
    mapping = _as_mapping(value)
    if mapping is None:
        raise ProbeError("option 'hparams': expected a dict of name -> value (or an argparse.Namespace, a "
                         f"dataclass, an object with to_dict()), got {show(value)}")
    return _json_value(mapping, 0, _Budget())


def flatten(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
