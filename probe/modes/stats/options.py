"""The config of the stats mode: ``probe.mode(probe.Stats(...), ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.modes.statistics.reduce import BACKENDS
from probe.vocabulary.option_fields import Check, boolean, choice, option
from probe.vocabulary.option_values import show


def _inputs(option_name: str, value: Any) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value == "external"):
        return value
    raise ProbeError(f"option 'inputs': expected True or False (or 'external'), got {show(value)}")


def _saturation(option_name: str, value: Any) -> bool | str:
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise ProbeError(f"option 'saturation': expected True, False or 'auto', got {show(value)}")


@dataclass(frozen=True, kw_only=True, eq=False)
class Stats(ModeConfig):
    """Statistics of every op's outputs (and its inputs from outside the step)."""

    mode = "stats"

    inputs: bool | str = option("external", check=Check(_inputs, "`True`, `False`, `'external'`"),
                                doc="inputs with statistics: all, none, or those from outside the step "
                                    "(weights, optimizer state, data), which `probe compare` needs")
    stats_backend: str = option("auto", check=choice(*BACKENDS),
                                doc="how the statistics are reduced on the device")
    saturation: bool | str = option("auto", check=Check(_saturation, "`True`, `False`, `'auto'`"),
                                    doc="count values at +-max of their dtype as Inf (`'auto'`: where "
                                        "overflow saturates, an Ascend NPU without inf/nan)")
    distribution: bool = option(False, check=boolean(),
                                doc="per value: shares of zeros, underflow and near-overflow of its dtype")
    histogram: bool = option(False, check=boolean(),
                             doc="per value: a log2-magnitude histogram (and the shares)")
    sketch: bool = option(False, check=boolean(),
                          doc="per value: 8 random-sign projections, so `probe compare` sees how far two "
                              "runs' elements are apart where statistics cannot (one more read per value)")
