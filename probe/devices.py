"""Device-agnostic helpers: the one place that knows how accelerators differ from the CPU.

Every accelerator torch knows (CUDA, Ascend NPU through ``torch_npu``, XPU, ...)
is driven through ``torch.accelerator``, ``torch.Event`` and ``torch.Stream``;
nothing in the probe names a device type other than "cpu" outside this module.
Releases older than torch 2.6 lack ``torch.accelerator``: there CUDA's own API
stands in.
"""

from __future__ import annotations

from typing import Any

import torch

_accelerator: Any = getattr(torch, "accelerator", None)


def is_accelerator(device: torch.device) -> bool:
    """Whether tensors on ``device`` are computed asynchronously on a stream."""
    return device.type not in ("cpu", "meta")


def current_device() -> torch.device | None:
    """The accelerator this process computes on (``cuda:0``, ``npu:3``), or None."""
    if _accelerator is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if not _accelerator.is_available():
        return None
    kind = _accelerator.current_accelerator().type
    return torch.device(kind, _accelerator.current_device_index())


def record_event(device: torch.device) -> Any:
    """An event recorded on the current stream of ``device``: waiting on it waits for
    the work queued there so far, and nothing else."""
    if _accelerator is None or not hasattr(torch, "Event"):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    event = torch.Event(device=device)
    event.record(_accelerator.current_stream(device))
    return event


def usable_device(device: str | torch.device, what: str = "device") -> torch.device:
    """``device`` as a ``torch.device`` that this process can compute on, else a ``ProbeError``
    naming it: a name torch does not know (``"bogus"``), a device this build or machine lacks
    (``"cuda"`` on a CPU build, ``"cuda:7"`` on a one-GPU machine), or ``meta`` (no values)."""
    from probe.errors import ProbeError

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ProbeError(f"{what} {str(device)!r} is not a device torch knows ({e})") from None
    if parsed.type == "meta":
        raise ProbeError(f"{what} {str(device)!r} holds no values: give a device that computes (cpu, cuda)")
    if parsed.type != "cpu":
        try:  # the one portable test: whether a tensor can be made there
            torch.empty(0, device=parsed)
        except (RuntimeError, AssertionError, AttributeError, ValueError) as e:
            raise ProbeError(f"{what} {str(device)!r} is not available here "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return parsed
