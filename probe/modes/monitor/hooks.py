"""The monitor's hooks: where its series are captured. Each monitored module's forward hooks and
its activations' gradient hooks (:class:`ModuleWatcher`), and the optimizer's step hooks
(:class:`OptimizerHooks`: weight gradients as the optimizer sees them, weights after the update,
Adam's moments and update). They hand what they see to the mode (:class:`Recorder`), which queues
it for the step's reduction."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from probe.errors import warn_once
from probe.modes.monitor.config import Target, describe_value
from probe.modes.monitor.options import Monitor
from probe.optimizer_steps import StepNesting, step_closure, with_closure
from probe.tracer.never_compiled import never_compiled


class Recorder(Protocol):
    """What the hooks ask of the monitor (``MonitorMode``)."""

    config: Monitor
    step: int
    """The step being collected."""
    collecting: bool
    """Whether this step's series are collected (not while paused, nor in a step ``steps=`` skips)."""

    def record(self, kind: str, name: str, slot: str, call: int, tensor: torch.Tensor) -> None:
        """Queue ``tensor``'s statistics as the series (kind, name, slot, call) of the step."""

    def record_adam_update(self, name: str, group: dict[str, Any], state: dict[str, Any]) -> bool:
        """Queue Adam's update of parameter ``name``; False when ``state`` is not Adam's."""

    def flush(self) -> None:
        """Reduce what is queued now (before the optimizer changes it in place)."""


def named_modules(model: Any) -> Iterator[tuple[str, nn.Module]]:
    roots = model.items() if isinstance(model, dict) else [("", model)]
    for prefix, root in roots:
        for name, module in root.named_modules():
            yield (f"{prefix}.{name}" if prefix and name else prefix or name), module


def named_parameters(model: Any) -> Iterator[tuple[str, nn.Parameter]]:
    roots = model.items() if isinstance(model, dict) else [("", model)]
    for prefix, root in roots:
        for name, param in root.named_parameters():
            yield (f"{prefix}.{name}" if prefix else name), param


def _in_backward() -> bool:
    """Forward hooks firing inside a graph task are checkpoint recompute."""
    return torch._C._current_graph_task_id() != -1


def install_module_hooks(recorder: Recorder, model: Any) -> tuple[int, list[Any]]:
    """A :class:`ModuleWatcher` on each module of ``model`` the targets match: how many, and the
    hooks' handles."""
    matched, handles = 0, []
    for fqn, module in named_modules(model):
        slots: dict[str, Any] = {}
        for target in recorder.config.targets:
            if target.matches(fqn):
                slots.update(target.slots)
        if not slots:
            continue
        matched += 1
        watcher = ModuleWatcher(recorder, fqn, Target(fqn, slots))
        handles.append(module.register_forward_pre_hook(watcher.before))
        handles.append(module.register_forward_hook(watcher.after))
    return matched, handles


class OptimizerHooks:
    """The global optimizer step hooks: weight gradients before the update (``wg_distribution``),
    weights (``param_distribution``), Adam's moments (``mv_distribution``) and update
    (``ur_distribution``) after it, of the parameters of :attr:`params`."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.params: dict[int, str] = {}
        """id(parameter) -> its name in the model."""
        self._closure_unread: set[int] = set()
        """Optimizers (ids) in a step whose closure has not run yet (weight grads not read)."""
        self._nesting = StepNesting()

    def install(self) -> list[Any]:
        """Register the hooks; their handles."""
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        return [register_optimizer_step_pre_hook(self._before_optimizer_step),
                register_optimizer_step_post_hook(self._after_optimizer_step)]

    def begin_step(self) -> None:
        # A step that raised inside optimizer.step never ran its post-hooks: start afresh.
        self._nesting.reset()
        self._closure_unread.clear()

    def _parameters(self, optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, torch.Tensor]]:
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self.params.get(id(param))
                if name is not None:
                    yield name, param

    def _record_weight_grads(self, optimizer: torch.optim.Optimizer, call: int) -> None:
        for name, param in self._parameters(optimizer):
            if param.grad is not None:
                self.recorder.record("weight_grad", name, "", call, param.grad)
        self.recorder.flush()

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        recorder = self.recorder
        outermost = self._nesting.enter(optimizer)  # super().step() runs the hooks again
        if not outermost or not recorder.collecting or not recorder.config.wg_distribution:
            return None
        closure = step_closure(args, kwargs)
        if closure is None:
            self._record_weight_grads(optimizer, 0)
            return None
        # optimizer.step(closure) (LBFGS, Lightning's automatic optimization): the closure's
        # backward makes the gradients the update uses, so they are read when it returns (the
        # grads here are the previous step's, or none). Each evaluation is a call of the series.
        calls = 0
        self._closure_unread.add(id(optimizer))

        def closure_then_grads() -> Any:
            nonlocal calls
            result = closure()
            self._closure_unread.discard(id(optimizer))
            if recorder.collecting:
                self._record_weight_grads(optimizer, calls)
            calls += 1
            return result

        return with_closure(args, kwargs, closure_then_grads)

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        recorder = self.recorder
        if not self._nesting.exit(optimizer):
            return
        if id(optimizer) in self._closure_unread:
            # A step given a closure it never called: its gradients are those it was given.
            self._closure_unread.discard(id(optimizer))
            if recorder.collecting:
                self._record_weight_grads(optimizer, 0)
        if not recorder.collecting:
            return
        config = recorder.config
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self.params.get(id(param))
                if name is None:
                    continue
                if config.param_distribution:
                    recorder.record("weight", name, "", 0, param)
                state = optimizer.state.get(param, {})
                if config.mv_distribution:
                    for key in ("exp_avg", "exp_avg_sq"):
                        if isinstance(state.get(key), torch.Tensor):
                            recorder.record(key, name, "", 0, state[key])
                if config.ur_distribution:
                    if not recorder.record_adam_update(name, group, state):
                        warn_once("monitor-ur", "monitor: ur_distribution needs Adam-family optimizer state "
                                  f"(exp_avg, exp_avg_sq, step); {type(optimizer).__name__} has none")
                        continue
                    if not config.param_distribution:  # the ratio's denominator
                        recorder.record("weight", name, "", 0, param)
        recorder.flush()


class ModuleWatcher:
    """The hooks of one monitored module: its slots, and its call count this step."""

    def __init__(self, mode: Recorder, fqn: str, target: Target) -> None:
        self.mode, self.fqn, self.slots = mode, fqn, target.slots
        self.calls = 0
        self.step = -1
        config = mode.config
        self.forward = not config.backward_only
        self.backward = not config.forward_only

    def _call_index(self) -> int:
        if self.step != self.mode.step:
            self.step, self.calls = self.mode.step, 0
        index = self.calls
        self.calls += 1
        return index

    def _grad_hook(self, slot: str, call: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if grad is not None:
                self.mode.record("activation", self.fqn, slot, call, grad)

        return hook

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def before(self, module: nn.Module, args: tuple) -> None:
        if not self.mode.collecting or not self.mode.config.xy_distribution or _in_backward():
            return
        self._current = self._call_index()
        self._capture(args, "input")

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def after(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self.mode.collecting or not self.mode.config.xy_distribution or _in_backward():
            return
        self._capture(output, "output")

    def _capture(self, value: Any, slot: str) -> None:
        """Record the ``slot`` ("input"/"output") tensor now and hook its gradient for ``slot_grad``
        (the gradient tuple autograd passes matches the value element for element)."""
        if slot == "input" and isinstance(value, tuple) and not value:
            # Called with keyword arguments only (an HF model's input_ids=...): nothing passed
            # positionally, so nothing to monitor and no spec that misfits.
            return
        spec = self.slots.get(slot)
        if spec is not None and self.forward:
            t = spec.select(value)
            if t is not None:
                self.mode.record("activation", self.fqn, slot, self._current, t)
            else:
                self._unmatched(slot, spec, value)
        grad_slot = f"{slot}_grad"
        spec = self.slots.get(grad_slot)
        if spec is not None and self.backward:
            t = spec.select(value)
            if t is None:
                self._unmatched(grad_slot, spec, value)
            elif t.requires_grad:
                t.register_hook(self._grad_hook(grad_slot, self._current))

    def _unmatched(self, slot: str, spec: Any, value: Any) -> None:
        """A spec that does not fit what the module passes gives no series: said once, never silent
        (raising here would stop the user's training step)."""
        grad = " (its gradient tuple matches it element for element)" if slot.endswith("_grad") else ""
        forward = slot.removesuffix("_grad")
        warn_once(f"monitor-spec:{slot}:{spec}",  # once per slot and spec: "*" targets many modules
                  f"monitor target {self.fqn!r} {slot}: {str(spec)!r} does not fit its {forward}, "
                  f"{describe_value(value)}{grad}, so it has no {slot} series; give a spec that selects a "
                  "tensor ('tensor', 'tuple[N]:i')")
