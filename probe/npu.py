"""Ascend NPU support through ``torch_npu``, which is optional and never imported here.

A process that trains on an NPU has imported ``torch_npu`` itself (it registers
the "npu" device); the probe only looks it up in ``sys.modules``, so without it
nothing here imports or costs anything.

In saturation mode (``torch_npu.npu.utils.is_support_inf_nan()`` False) an
overflowing NPU op writes +-max of its dtype instead of inf, which ``isinf``
misses. The probe then counts values at +-max as Inf in the statistics (on the
device, no sync) and reads the NPU's global overflow flag once per step.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch

NPU_OP_NAMESPACE = "npu"
"""torch_npu's fused kernels (``torch.ops.npu.npu_rms_norm`` ...): recorded by name like aten ops."""


def torch_npu_module() -> ModuleType | None:
    """``torch_npu`` when this process imported it, else None (never imports it)."""
    return sys.modules.get("torch_npu")


def _npu_utils() -> Any:
    module = torch_npu_module()
    return None if module is None else getattr(getattr(module, "npu", None), "utils", None)


def saturation_mode(device: torch.device) -> bool:
    """Whether overflow on ``device`` saturates to +-max instead of producing inf."""
    if device.type != "npu":
        return False
    utils = _npu_utils()
    is_support_inf_nan = getattr(utils, "is_support_inf_nan", None)
    if is_support_inf_nan is None:
        return False
    return not is_support_inf_nan()


def read_and_clear_overflow_flag() -> bool | None:
    """The NPU's global overflow flag since the last call (cleared), or None without an NPU.

    One host read: called once per step, after the step's work was queued.
    """
    module = torch_npu_module()
    if module is None:
        return None
    places = (getattr(torch, "npu", None), _npu_utils())
    get = next((f for p in places if (f := getattr(p, "get_npu_overflow_flag", None))), None)
    clear = next((f for p in places if (f := getattr(p, "clear_npu_overflow_flag", None))), None)
    if get is None:
        return None
    flag = bool(get())
    if clear is not None:
        clear()
    return flag
