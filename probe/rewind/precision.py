"""The whole step in float64: what the rewind's precision rerun runs in.

Parameters, buffers, gradients and the optimizer's per-parameter state are upcast in place (the same
Parameter objects, so the optimizer and the user's closure keep working), the batch's floating
tensors too, and ``torch.autocast`` blocks entered inside the step are turned off. The probe's upcast
mode is not enough here: it computes each op wide but rounds its result back to the op's dtype, so
an fp16 overflow stays an overflow. The rewind puts the kept start back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from probe.rewind.start import Batch, leaves, rebuild

WIDE = torch.float64


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(WIDE) if t.is_floating_point() else t


@contextmanager
def autocast_off() -> Iterator[None]:
    """``torch.autocast(...)`` blocks entered meanwhile run with ``enabled=False``."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__init__

    def disabled(self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        original(self, device_type, dtype=dtype, enabled=False, cache_enabled=cache_enabled)

    autocast.__init__ = disabled  # type: ignore[method-assign]
    try:
        yield
    finally:
        autocast.__init__ = original  # type: ignore[method-assign]


@contextmanager
def float64_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Batch) -> Iterator[Batch]:
    """Upcast ``model`` (and ``optimizer``'s state) in place and give the batch in float64, with
    autocast off, for the block. Refused (before anything changes) for a model sharded by FSDP2's
    ``fully_shard``: its all-gather fills unsharded parameters of the dtype fixed when it was
    sharded, whatever the shards hold."""
    sharded = _fully_sharded(model)
    if sharded is not None:
        raise NotImplementedError(f"{sharded or 'the model'} is sharded by FSDP2's fully_shard, whose "
                                  "all-gather keeps the dtype its parameters had when sharded: no "
                                  "float64 step in place")
    with torch.no_grad():
        for param in model.parameters():
            param.data = _wide(param.data)
            if param.grad is not None:
                param.grad = _wide(param.grad)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = _wide(buffer)
        if optimizer is not None:
            for param, state in optimizer.state.items():
                for key, value in state.items():
                    # The moments have the parameter's shape; counters ("step") keep their dtype.
                    if isinstance(value, torch.Tensor) and value.shape == param.shape:
                        state[key] = _wide(value)
    with autocast_off():
        yield rebuild(batch, iter([_wide(t) for t in leaves(batch)]))


def _fully_sharded(model: nn.Module) -> str | None:
    """The name of the first module of ``model`` that FSDP2 shards ("" for the model itself), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return None
    return next((name for name, module in model.named_modules() if isinstance(module, FSDPModule)), None)
