"""The toy mode's config: its one option, declared once; and the other tool's config file form
it reads (``config=``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError
from probe.modes.config import CONFIG_FILE_FORMS, ConfigFileForm, ModeConfig
from probe.vocabulary.option_fields import choice, option
from probe.vocabulary.option_values import show


@dataclass(frozen=True, kw_only=True, eq=False)
class Toy(ModeConfig):
    """Count the ops of each step (``probe.mode(Toy(phases=...))``)."""

    mode = "toy"
    phases: str = option("all", check=choice("all", "forward"), doc="which phases' ops the toy counts")


def is_counter_config(config: Mapping[str, Any]) -> bool:
    """Another tool's form of the same request: ``{"op_counter": {"forward_only": bool}}``."""
    return set(config) == {"op_counter"}


def from_counter_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``probe.mode`` options for the other tool's form: a toy config."""
    counter = config["op_counter"]
    if not isinstance(counter, Mapping) or not isinstance(counter.get("forward_only", False), bool):
        raise ProbeError(f"op_counter: expected {{'forward_only': true or false}}, got {show(counter)}")
    return {"mode": [Toy(phases="forward" if counter.get("forward_only") else "all")]}


CONFIG_FILE_FORMS.append(ConfigFileForm(is_counter_config, from_counter_config))
