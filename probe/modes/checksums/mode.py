"""Mode "checksums": what a step started from, so ``probe compare`` can tell whether two runs
started alike (``probe.analysis.run_identity``).

Added to every session given ``model=`` (``checksums=False`` turns it off; it can also be
selected alone, ``probe.mode("checksums", model=model)``, to record only this). At the
first call of the model (each root of ``model=``) in a recorded step, a forward pre-hook
queues:

- **parameters**: a checksum of each parameter's bits (``probe.modes.checksums.bit_checksum``), at
  the session's first recorded step (the weights the run started from; every step with
  ``checksums=[..., "parameters_each_step"]``: reading every weight once a step costs
  about a ``sum`` over the model, 3% of a CPU step of a LLaMA-7B-wide layer, see
  docs/format.md); with them, each **buffer**'s (``named_buffers()``, non-persistent ones
  included: a rotary embedding's ``inv_freq`` shapes every attention as much as a weight);
- **inputs**: a checksum of each tensor argument of the first :data:`MAX_CALLS` calls of
  the model in the step (``input_ids``, ``labels``, ...);
- **rng**: the state of torch's CPU generator, the current accelerator's, Python's
  ``random`` and NumPy's global generator (what dropout and sampling will draw from).

All of it is queued on the tensors' device without a host sync (the RNG states are host
copies); the writer thread reads the checksums and writes ``checksums.json`` with the
step. The hook runs outside the dispatch mode and without autograd: the model's ops and
results are untouched, and no random number is drawn.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.devices import current_device, is_accelerator, record_event
from probe.errors import ProbeError, warn_once
from probe.modes.base import SessionPlugin
from probe.modes.checksums.bit_checksum import (
    ChecksumCache,
    checksummable,
    combine,
    hex_checksum,
    local,
    row_sums,
)
from probe.modes.checksums.files import CHECKSUMS_FILE, ChecksumsFiles
from probe.modes.checksums.options import Checksums
from probe.modes.registry import register_mode
from probe.rundir.writer import StepWriter
from probe.tracer.mode_stack import untraced
from probe.vocabulary.option_values import DEFAULT_CHECKSUMS, IntSet

MAX_CALLS = 8
"""Calls of the model per step whose inputs are checksummed (a generation loop calls it often)."""
MAX_INPUT_TENSORS = 64
"""Tensor arguments checksummed per call (the first ones, in argument order)."""
_MAX_DEPTH = 4


def _roots(model: Any) -> list[tuple[str, torch.nn.Module]]:
    return list(model.items()) if isinstance(model, dict) else [("", model)]


def _tensors_of(value: Any, path: str, depth: int, into: list[tuple[str, torch.Tensor]]) -> None:
    """The tensors inside an argument (tuples, lists, dicts, HF ``ModelOutput``s), with their paths."""
    if len(into) >= MAX_INPUT_TENSORS or depth > _MAX_DEPTH:
        return
    if isinstance(value, torch.Tensor):
        into.append((path, value))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _tensors_of(item, f"{path}[{i}]", depth + 1, into)
    elif isinstance(value, dict):
        for key, item in value.items():
            _tensors_of(item, f"{path}.{key}" if path else str(key), depth + 1, into)


@dataclass
class _Queued:
    """Tensors whose checksums are queued on their devices: names, dtypes, shapes and, per
    device, the positions and the device tensor of checksums."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    groups: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], cache: ChecksumCache) -> _Queued:
        queued = cls()
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for name, tensor in named:
            position = len(queued.names)
            queued.names.append(name)
            queued.dtypes.append(str(tensor.dtype).removeprefix("torch."))
            queued.shapes.append(list(tensor.shape))
            try:
                plain = local(tensor)
                if checksummable(plain):
                    by_device.setdefault(plain.device, []).append((position, row_sums(plain)))
            except (RuntimeError, TypeError, NotImplementedError) as e:  # a layout the checksum cannot read
                warn_once("checksums-failed", f"checksums: cannot checksum {name} ({e}); tensors like it "
                          "are recorded without a checksum")
        for group in by_device.values():
            queued.groups.append(([p for p, _ in group], combine([rows for _, rows in group], cache)))
        return queued

    def to_json(self) -> dict[str, Any]:
        """Reads the device (writer thread only)."""
        values: list[str | None] = [None] * len(self.names)
        for positions, found in self.groups:
            for position, value in zip(positions, found.cpu().tolist(), strict=True):
                values[position] = hex_checksum(value)
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes, "checksums": values}


def _rng_states() -> dict[str, Any]:
    """Copies of the generators' states (host data; hashed on the writer thread)."""
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    device = current_device()
    if device is not None:
        module = getattr(torch, device.type, None)
        initialized = getattr(module, "is_initialized", None)
        # Never initialise a device for this: an uninitialised device has drawn nothing yet.
        if module is not None and (initialized is None or initialized()):
            with contextlib.suppress(Exception):  # a backend without get_rng_state
                states[device.type] = module.get_rng_state(device.index)
    states["python"] = random.getstate()
    states["numpy"] = np.random.get_state()
    return states


def _digest(state: Any) -> str:
    if isinstance(state, torch.Tensor):
        data = state.numpy().tobytes()
    elif isinstance(state, tuple) and state and state[0] == "MT19937":  # NumPy's legacy state
        data = state[1].tobytes() + repr(state[2:]).encode()
    else:
        data = repr(state).encode()
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass
class _Call:
    module: str
    call: int
    inputs: _Queued


class ChecksumsStep:
    """One step's queued checksums, written as ``checksums.json`` on the writer thread."""

    def __init__(self, parameters: _Queued | None, calls: list[_Call], rng: dict[str, Any] | None,
                 buffers: _Queued | None = None) -> None:
        self.parameters, self.calls, self.rng, self.buffers = parameters, calls, rng, buffers
        self.on_written: Callable[[], None] | None = None
        # Marks, on the training thread's streams, the end of the step's queued checksums: the writer
        # thread waits on them (its own stream would not order it after them).
        queued = [q for q in (parameters, buffers, *(c.inputs for c in calls)) if q is not None]
        devices = {values.device for q in queued for _, values in q.groups}
        self.events = [record_event(device) for device in devices if is_accelerator(device)]

    def write(self, writer: StepWriter) -> dict[str, Any]:
        for event in self.events:
            event.synchronize()
        data: dict[str, Any] = {}
        if self.parameters is not None:
            data["parameters"] = self.parameters.to_json()
        if self.buffers is not None:
            data["buffers"] = self.buffers.to_json()
        if self.calls:
            data["inputs"] = [{"module": c.module, "call": c.call, **c.inputs.to_json()} for c in self.calls]
        if self.rng is not None:
            data["rng"] = {kind: _digest(state) for kind, state in self.rng.items()}
        writer.write_json(CHECKSUMS_FILE, data)
        if self.on_written is not None:
            self.on_written()
        return {"parameters": len(self.parameters.names) if self.parameters is not None else None,
                "buffers": len(self.buffers.names) if self.buffers is not None else None,
                "inputs": len(self.calls) if "inputs" in data else None,
                "rng": sorted(data["rng"]) if "rng" in data else None}


@register_mode
class ChecksumsMode(SessionPlugin):
    """Checksums of the parameters, the model's inputs and the RNG states (no per-op work)."""

    name = "checksums"
    config_class = Checksums
    files = ChecksumsFiles

    @classmethod
    def added_by_session(cls, options: Any, selected: list[SessionPlugin]) -> ChecksumsMode | None:
        return plugin_for(options, selected)

    def __init__(self, config: Checksums | None = None, *, kinds: frozenset[str] = DEFAULT_CHECKSUMS,
                 steps: IntSet | None = None, implicit: bool = False) -> None:
        super().__init__(config if config is not None else Checksums())
        self.kinds = kinds
        self.steps = steps if steps is not None else IntSet(None)
        self.implicit = implicit
        """Added by the session for ``model=`` (not selected): it writes into the steps the selected
        modes write, and makes no step of its own."""
        self._cache = ChecksumCache()
        self._params: list[tuple[str, torch.Tensor]] = []
        self._roots: list[tuple[str, torch.nn.Module]] = []
        self._handles: list[Any] = []
        self._collecting = self._collecting_before_pause = False
        # The step holding the initial parameters' checksums: weakly, to know whether the session
        # wrote it or let it go (a step no selected mode wrote, when the plug-in is implicit).
        self._parameters_step: weakref.ref[ChecksumsStep] | None = None
        self._parameters_written = False
        self._reset()

    def _reset(self) -> None:
        self._started = False
        self._parameters: _Queued | None = None
        self._buffers: _Queued | None = None
        self._calls: list[_Call] = []
        self._rng: dict[str, Any] | None = None

    def attach(self, model: Any, out: Path, rank: int) -> None:
        if model is None:
            raise ProbeError("mode 'checksums' needs model= (the module whose parameters and inputs it "
                             "checksums)")
        roots = self._roots = _roots(model)
        self._params = [(f"{prefix}.{name}" if prefix else name, p)
                        for prefix, root in roots for name, p in root.named_parameters()]
        # A model compiled already: its compiled call runs the hook eagerly, not traced into its graph
        # (only then: importing dynamo for it would cost a session without compiled code seconds).
        disable = getattr(torch.compiler, "disable", None) if "torch._dynamo" in sys.modules else None
        for prefix, root in roots:
            hook = self._hook(prefix)
            self._handles.append(root.register_forward_pre_hook(
                disable(hook) if disable is not None else hook, with_kwargs=True))

    def begin_step(self, step: int) -> None:
        self._reset()
        self._collecting = bool(self._handles) and step in self.steps

    def pause(self) -> None:
        self._collecting_before_pause, self._collecting = self._collecting, False

    def resume(self) -> None:
        self._collecting = self._collecting_before_pause

    def _hook(self, prefix: str) -> Any:
        def before_forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self._collecting:
                with untraced(), torch.no_grad():
                    self._record(prefix, args, kwargs)
        return before_forward

    def _record(self, prefix: str, args: tuple, kwargs: dict) -> None:
        if not self._started:
            self._started = True
            each_step = "parameters_each_step" in self.kinds
            if each_step or ("parameters" in self.kinds and not self._parameters_recorded()):
                self._parameters = _Queued.of(self._params, self._cache)
                # Found now, not at attach: a model may replace a buffer (rotary scaling does).
                buffers = [(f"{prefix}.{name}" if prefix else name, b)
                           for prefix, root in self._roots for name, b in root.named_buffers()]
                self._buffers = _Queued.of(buffers, self._cache)
            if "rng" in self.kinds:
                self._rng = _rng_states()
        if "inputs" in self.kinds and len(self._calls) < MAX_CALLS:
            named: list[tuple[str, torch.Tensor]] = []
            _tensors_of(list(args), "args", 0, named)
            _tensors_of(kwargs, "", 0, named)
            call = sum(c.module == prefix for c in self._calls)
            self._calls.append(_Call(prefix, call, _Queued.of(named, self._cache)))

    def _parameters_were_written(self) -> None:
        self._parameters_written = True  # on the writer thread: one assignment, read on the training thread

    def _parameters_recorded(self) -> bool:
        """Whether an earlier step's parameter checksums were written, or are on their way to the
        writer (a step the session did not write is let go: then the next step records them)."""
        if self._parameters_written:
            return True
        return self._parameters_step is not None and self._parameters_step() is not None

    def end_step(self, step: int) -> ChecksumsStep | None:
        found = (ChecksumsStep(self._parameters, self._calls, self._rng, self._buffers) if self._started
                 else None)
        if found is not None and found.parameters is not None and "parameters_each_step" not in self.kinds:
            self._parameters_step = weakref.ref(found)
            found.on_written = self._parameters_were_written
        self._reset()
        return found

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def plugin_for(options: Any, selected: list[SessionPlugin]) -> ChecksumsMode | None:
    """The checksums plug-in a session adds for ``model=`` (None: no model, ``checksums=False``,
    or selected by name already, then configured here)."""
    for mode in selected:
        if isinstance(mode, ChecksumsMode):
            if options.model is None:
                raise ProbeError("mode 'checksums' needs model= (the module whose parameters and inputs it "
                                 "checksums)")
            if not options.checksums:
                raise ProbeError("mode 'checksums' with checksums=False records nothing; select another "
                                 "mode or leave checksums at its default")
            mode.kinds, mode.steps = options.checksums, options.steps
            return None
    if options.model is None or not options.checksums:
        return None
    return ChecksumsMode(kinds=options.checksums, steps=options.steps, implicit=True)

