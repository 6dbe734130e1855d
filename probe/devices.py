"""Device-agnostic helpers: the one place that knows how accelerators differ from the CPU.

Every accelerator torch knows (CUDA, Ascend NPU through ``torch_npu``, XPU, ...)
is driven through ``torch.accelerator``, ``torch.Event`` and ``torch.Stream``;
nothing in the probe names a device type other than "cpu" outside this module.
"""

from __future__ import annotations

import torch


def is_accelerator(device: torch.device) -> bool:
    """Whether tensors on ``device`` are computed asynchronously on a stream."""
    return device.type not in ("cpu", "meta")


def has_accelerator() -> bool:
    """Whether this process has an accelerator (CUDA, NPU, ...) to run on."""
    return torch.accelerator.is_available()


def record_event(device: torch.device) -> torch.Event:
    """An event recorded on the current stream of ``device``: waiting on it waits for
    the work queued there so far, and nothing else."""
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    if is_accelerator(device):
        torch.accelerator.synchronize(device)
