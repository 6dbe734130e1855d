"""Mode "upcast": selected low-precision ops computed in fp32 (or fp64), results rounded back.

Per-op upcasting alone often changes nothing: CPU kernels, and many GPU ones,
already compute fp16/bf16 in fp32 and round once. What loses precision is
rounding *between* ops. So inside the selection (the ``ops``/``modules``/``phases``
options) the higher precision carries across ops: every low-precision tensor a
selected op produces gets a higher-precision *shadow*, later selected ops consume
the shadow instead of the rounded tensor, and only the rounded value is what
the rest of the program sees. Shadows are held by weak reference to their
tensor and die with it; a tensor written in place since its shadow was made
has no shadow any more.

Each selected op first runs as it is (so dtype, shape, strides, in-place and
autograd semantics are the original op's), then again in the higher
precision; the result is copied, rounded, into the original output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from probe.modes.base import Mode
from probe.modes.registry import register_mode
from probe.modes.rerunnable import eligible
from probe.modes.upcast.options import Upcast
from probe.tracer.op_call import OpCall
from probe.vocabulary.op_tensors import map_arguments, results_of

_LOW = (torch.float16, torch.bfloat16)


@register_mode
class UpcastMode(Mode):
    """Higher precision inside a selected scope, carried across its ops by shadows."""

    name = "upcast"
    config_class = Upcast

    def __init__(self, config: Upcast) -> None:
        super().__init__(config)
        self.dtype = config.upcast_dtype
        # tensor -> (the version its shadow is valid at, the shadow)
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._snapshots: dict[int, dict[int, torch.Tensor]] = {}

    def _low(self, t: torch.Tensor) -> bool:
        return t.dtype in _LOW or (self.dtype == torch.float64 and t.dtype == torch.float32)

    def before(self, call: OpCall) -> None:
        if not eligible(call.info) or not any(self._low(t) for t in call.input_tensors or ()):
            return
        written = {id(t) for t in call.written()}
        self._snapshots[call.index] = {
            id(t): self._shadow_or_upcast(t).clone() for t in call.input_tensors or () if id(t) in written
        }

    def _shadow_or_upcast(self, t: torch.Tensor) -> torch.Tensor:
        found = self._shadows.get(t)
        if found is not None and found[0] == t._version:
            return found[1]
        return t.to(self.dtype) if self._low(t) else t

    def after(self, call: OpCall) -> None:
        snapshot = self._snapshots.pop(call.index, None)
        if snapshot is None:
            return

        def convert(value: Any) -> Any:  # one argument; map_arguments walks the lists
            if isinstance(value, torch.Tensor):
                return snapshot[id(value)] if id(value) in snapshot else self._shadow_or_upcast(value)
            if isinstance(value, torch.dtype) and value in _LOW:
                return self.dtype  # a dtype argument (sum(dtype=...)) follows the upcast
            return value

        args = [map_arguments(a, convert) for a in call.args]
        kwargs = {k: map_arguments(v, convert) for k, v in (call.kwargs or {}).items()}
        results = results_of(call.info, args, kwargs, call.func(*args, **kwargs))
        moving = call.versions_moving()
        for position, original in enumerate(call.output_tensors or ()):
            if position >= len(results) or not self._low(original):
                continue
            exact = results[position]
            if exact.shape != original.shape or not exact.is_floating_point():
                continue
            with torch.no_grad():
                original.copy_(exact)
            mutated = call.outputs[position][2]
            bump = 1 if any(original is m for m in moving) else 0
            if mutated and bump == 0:
                self._shadows.pop(original, None)
            else:
                self._shadows[original] = (original._version + (bump if mutated else 0), exact)
