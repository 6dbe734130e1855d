"""The config of the upcast mode: ``probe.mode(probe.Upcast(...), ...)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.errors import ProbeError
from probe.modes.config import ModeConfig
from probe.vocabulary.option_fields import Check, option
from probe.vocabulary.option_values import show

_UPCAST_DTYPES = {torch.float32: torch.float32, torch.float64: torch.float64,
                  "float32": torch.float32, "float64": torch.float64}


def _dtype(option_name: str, value: Any) -> torch.dtype:
    """``torch.float32`` or ``torch.float64`` (``"float32"``/``"float64"`` in a JSON config, which
    cannot hold a dtype)."""
    dtype = _UPCAST_DTYPES.get(value) if isinstance(value, (str, torch.dtype)) else None
    if dtype is None:
        raise ProbeError(f"option 'upcast_dtype': {show(value)} is not one of torch.float32, "
                         "torch.float64, 'float32', 'float64'")
    return dtype


@dataclass(frozen=True, kw_only=True, eq=False)
class Upcast(ModeConfig):
    """Modules computed in higher precision, carried across their ops."""

    mode = "upcast"

    upcast_dtype: torch.dtype = option(
        torch.float32,
        check=Check(_dtype, "`torch.float32`, `torch.float64` (`'float32'`, `'float64'` in JSON)"),
        doc="the precision the selected modules compute in")
