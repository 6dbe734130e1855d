"""Which module (and which call of it) an op belongs to, in every phase.

Global module forward hooks keep a stack of open :class:`Frame` s. For backward,
the frame is found through the autograd node the engine is running: right after
a forward op, ``_get_sequence_nr() - 1`` is the sequence number of the node that
op created, so ``seq -> frame`` is remembered in forward and looked up with
``_current_autograd_node()._sequence_nr()`` in backward. Gradient accumulation
nodes carry no sequence number of their own; their ``.variable`` is the
parameter, attributed to the module that owns it.

Dispatch modes are per thread: the probe's sees the ops of the threads whose dispatch stack
holds it (the one that entered the session, the autograd engine's threads working for it, and
those inside ``session.trace_thread()``). Module and optimizer hooks are global and run on the
calling thread, so a hook call on any other thread is the evidence that ops ran unseen there:
it is counted per thread (:attr:`ModuleTracker.untraced_calls`, written to the step's manifest)
and warned about once, and its frames are kept off the traced threads' stack.
"""

from __future__ import annotations

import itertools
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from probe.errors import warn_once
from probe.optimizer_steps import step_closure, with_closure
from probe.tracer.autocast_policy import AutocastPolicies
from probe.tracer.frames import Frame
from probe.tracer.never_compiled import never_compiled
from probe.tracer.updated_parameters import UpdatedParameters

_ACCUMULATE_GRAD_SEQ = 2**64 - 1
_FSDP_REGION = re.compile(r"FSDP::\w+ \((?P<fqn>[^()]*)\)|FSDP::\w+_prefetch for (?P<target>.+)")

# Missing on old torch releases: compat.check_dispatch_features warns once, and
# every op is then attributed as forward outside any backward node.
_get_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", lambda: 0)
_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
# Global module hooks also fire inside code dynamo traces (a compiled submodule's children
# under compiled="keep"); there they must be no-ops: dynamo cannot trace the autograd queries,
# and the compiled call is recorded as one region op of the module that called it.
_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_is_grad_enabled = torch.is_grad_enabled
_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_get_ident = threading.get_ident
_trackers = itertools.count()
"""Numbers the trackers, so that each session warns once of its own untraced threads."""


def parallel_layout(root: nn.Module) -> str | None:
    """How ``root`` holds its parameters across ranks: "replicated" (DDP), "sharded" (DTensor
    parameters: FSDP2, tensor parallel) or None (not known)."""
    if isinstance(root, nn.parallel.DistributedDataParallel):
        return "replicated"
    dtensor = getattr(torch.distributed, "tensor", None)
    dtensor_type = getattr(dtensor, "DTensor", None) if dtensor is not None else None
    if dtensor_type is not None and any(isinstance(p, dtensor_type) for p in root.parameters()):
        return "sharded"
    return None


class ModuleNames:
    """``module -> FQN`` from the configured roots, or from the first module called."""

    def __init__(self, roots: nn.Module | dict[str, nn.Module] | None) -> None:
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.param_names: dict[int, str] = {}
        """``id(parameter)`` -> its name (``layers.0.mlp.up.weight``): what an optimizer op updates,
        and, without its last part, the module that owns it."""
        self.types: dict[str, str] = {}
        """FQN -> module class name (for exports that name modules by class)."""
        self._auto_root = roots is None
        self._roots = 0
        self.parallel: str | None = None
        """How the roots hold their parameters across ranks: "replicated" (DDP),
        "sharded" (DTensor parameters: FSDP2, tensor parallel) or None (not known)."""
        if isinstance(roots, nn.Module):
            self.add_root(roots, "")
        elif isinstance(roots, dict):
            for prefix, module in roots.items():
                self.add_root(module, prefix)

    def add_root(self, root: nn.Module, prefix: str) -> None:
        self._roots += 1
        self.parallel = parallel_layout(root) or self.parallel
        for name, module in root.named_modules(remove_duplicate=False):
            fqn = f"{prefix}.{name}" if prefix and name else (prefix or name)
            self._names.setdefault(module, fqn)
            self.types.setdefault(fqn, type(module).__name__)
        for name, param in root.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)

    def name(self, module: nn.Module, parent: Frame | None) -> str | None:
        """The FQN of ``module``; ``None`` for modules that are not the user's (FX subgraphs)."""
        fqn = self._names.get(module)
        if fqn is not None:
            return fqn
        if isinstance(module, torch.fx.GraphModule):
            return None
        if parent is None and self._auto_root:
            # The outermost module called is taken as the root; later outermost
            # modules outside its tree (a loss module, say) are named by class.
            self.add_root(module, "" if self._roots == 0 else type(module).__name__)
            return self._names[module]
        if isinstance(module, nn.parallel.DistributedDataParallel):  # a wrapper around model=
            self.parallel = "replicated"
        base = parent.fqn if parent is not None else ""
        fqn = f"{base}.{type(module).__name__}" if base else type(module).__name__
        self.types.setdefault(fqn, type(module).__name__)
        return fqn

    def known(self, module: Any) -> str | None:
        """The FQN of ``module`` where it is one of the roots' modules (None otherwise)."""
        return self._names.get(module) if isinstance(module, nn.Module) else None

    def param_owner(self, param: torch.Tensor) -> str | None:
        name = self.param_names.get(id(param))
        return None if name is None else name.rpartition(".")[0]


class ModuleTracker:
    """Keeps the stack of open frames and answers "which phase, which frame" per op."""

    def __init__(self, roots: nn.Module | dict[str, nn.Module] | None) -> None:
        self.names = ModuleNames(roots)
        self.enabled = False
        self._handles: list[Any] = []
        self.traced_threads: set[int] = set()
        """Idents of the threads whose dispatch stack holds the probe's mode (set by whoever
        enters it there: ``probe.lifecycle.traced``, ``Tracer.trace_thread``)."""
        self.traces_current_thread: Callable[[], bool] = lambda: False
        """Whether the calling thread's dispatch stack holds the probe's mode (an autograd engine
        thread inherits it from the thread that called ``backward()``); set by the tracer."""
        self._number = next(_trackers)
        self.policies = AutocastPolicies()
        self.updated = UpdatedParameters()
        """Which parameter each op of the optimizer step works for."""
        self.reset_step()

    # -- lifecycle -------------------------------------------------------------

    def install(self) -> None:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._handles.append(register_module_forward_pre_hook(self._enter_module))
        self._handles.append(register_module_forward_hook(self._exit_module, always_call=True))
        try:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )
        except ImportError:  # pragma: no cover - very old torch
            return
        self._handles.append(register_optimizer_step_pre_hook(self._enter_optimizer))
        self._handles.append(register_optimizer_step_post_hook(self._exit_optimizer))

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset_step(self) -> None:
        """Forget the frames of the step that ended; call indices restart at 0."""
        self.outside = Frame("", -1, None)
        self.stack: list[Frame] = []
        self._frame_modules: list[Callable[[], nn.Module | None]] = []
        self._calls: dict[str, int] = {}
        self._last_call: dict[str, Frame] = {}
        self._seq_frames: dict[int, Frame] = {}
        self._optimizer: Frame | None = None
        self._optimizer_depth = 0
        self.updated.stop()
        self._regions: list[Frame | None] = []
        self.region: Frame | None = None
        """The module frame an engine's ``record_function`` region speaks for, if any."""
        self.untraced_calls: dict[str, int] = {}
        """Thread name -> module and optimizer calls this step on that thread, which the dispatch
        mode does not see: their ops are not recorded."""
        self.autocast = self.policies.current()
        """The id of autocast's state as last read (at the step's start, then at each module call's
        entry and exit: ``probe.tracer.autocast_policy``)."""

    # -- hooks -----------------------------------------------------------------

    def _next_call(self, name: str) -> int:
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        return call

    def _on_untraced_thread(self, called: nn.Module | torch.optim.Optimizer) -> bool:
        """Whether this hook call (of module or optimizer ``called``) runs on a thread the dispatch
        mode does not see; if so it is counted and, the first time, warned about. Cheap on a
        traced thread: one set lookup."""
        if _get_ident() in self.traced_threads or self.traces_current_thread():
            return False
        name = threading.current_thread().name
        kind = type(called).__name__
        what = f"a call of module {kind}" if isinstance(called, nn.Module) else f"{kind}.step()"
        self.untraced_calls[name] = self.untraced_calls.get(name, 0) + 1
        warn_once(
            f"untraced-thread:{self._number}",
            f"{what} ran on thread {name!r}, where the probe's dispatch mode is not active (a "
            "TorchDispatchMode sees the ops of the threads it was entered on): the ops there are not "
            "traced, and each step's manifest counts the calls as untraced_threads. Start the session "
            "on the thread that trains, or run that thread's work inside `with session.trace_thread():`",
        )
        return True

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _enter_module(self, module: nn.Module, args: Any) -> None:
        if not self.enabled or _is_compiling():
            return
        if self._on_untraced_thread(module):
            return
        parent = self.stack[-1] if self.stack else self.outside
        fqn = self.names.name(module, parent if self.stack else None)
        if fqn is None:
            return
        if _current_graph_task_id() != -1:
            frame = self._recompute_frame(fqn, parent)
        else:
            frame = Frame(fqn, self._next_call(fqn), parent)
            parent.children.setdefault(fqn, []).append(frame)
            self._last_call[fqn] = frame
        frame_module = weakref.ref(module)
        self.stack.append(frame)
        self._frame_modules.append(frame_module)
        self.autocast = self.policies.current()

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _exit_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.enabled or not self.stack or _is_compiling():
            return None
        if _get_ident() not in self.traced_threads and not self.traces_current_thread():
            return None  # its entry was counted and left off the stack
        # Pop down to this module's frame: with always_call the exit hook also
        # runs when forward raised, possibly after inner frames were left open.
        for depth in range(len(self.stack) - 1, -1, -1):
            if self._frame_modules[depth]() is module:
                del self.stack[depth:]
                del self._frame_modules[depth:]
                break
        self.autocast = self.policies.current()
        return None

    def _recompute_frame(self, fqn: str, parent: Frame) -> Frame:
        origin: Frame | None = None
        if parent.recompute:
            # The j-th recomputed child `fqn` of a recompute frame repeats the
            # j-th forward child `fqn` of the frame its parent repeats.
            j = parent.recompute_children.get(fqn, 0)
            parent.recompute_children[fqn] = j + 1
            if parent.recompute_of is not None:
                siblings = parent.recompute_of.children.get(fqn, [])
                origin = siblings[j] if j < len(siblings) else None
        else:
            # Outermost recomputed module: the node whose saved tensor triggered
            # the recompute was created inside the forward call being repeated.
            node = _current_autograd_node()
            created_in = self._seq_frames.get(node._sequence_nr()) if node is not None else None
            if created_in is not None:
                origin = created_in.find_enclosing(fqn)
        if origin is None:
            origin = self._last_call.get(fqn)
        call = origin.call if origin is not None else self._next_call(fqn)
        return Frame(fqn, call, parent, recompute=True, recompute_of=origin)

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _enter_optimizer(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.enabled or self._on_untraced_thread(optimizer):
            return None
        self._optimizer_depth += 1
        if self._optimizer_depth == 1:
            label = f"optimizer.{type(optimizer).__name__}"
            self._optimizer = Frame("", self._next_call(label), None, label=label)
        self.updated.start(optimizer, self.names.param_names)
        return self._closure_outside_optimizer(args, kwargs)

    def _closure_outside_optimizer(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """``optimizer.step(closure)`` (LBFGS; Lightning's automatic optimization) runs the
        closure's forward and backward inside the step: they are the model's ops, not the
        optimizer's, so the closure runs with the optimizer frame closed."""
        closure = step_closure(args, kwargs)
        if closure is None:
            return None

        def closure_as_model_ops() -> Any:
            saved = self._optimizer, self._optimizer_depth
            self._optimizer, self._optimizer_depth = None, 0
            try:
                return closure()
            finally:
                self._optimizer, self._optimizer_depth = saved

        return with_closure(args, kwargs, closure_as_model_ops)

    @never_compiled  # torch calls it from the eager code between a compiled model's graphs
    def _exit_optimizer(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.enabled or self._optimizer_depth == 0:
            return
        if _get_ident() not in self.traced_threads and not self.traces_current_thread():
            return
        self._optimizer_depth -= 1
        if self._optimizer_depth == 0:
            self._optimizer = None
            self.updated.stop()

    # -- engine regions --------------------------------------------------------

    def enter_region(self, label: str) -> None:
        """A ``record_function`` region opens. FSDP2 names the module a region works for
        ("FSDP::post_backward_reduce (layers.0)", "FSDP::backward_prefetch for layers.1"):
        its all-gathers and reduce-scatters run from hooks outside that module's own calls,
        so they are attributed to the module's latest call instead."""
        frame = None
        if label.startswith("FSDP::"):
            m = _FSDP_REGION.fullmatch(label)
            if m is not None:
                frame = self._last_call.get(m["fqn"] if m["fqn"] is not None else m["target"])
        self._regions.append(frame)
        self.region = frame if frame is not None else self.region

    def exit_region(self) -> None:
        if self._regions:
            self._regions.pop()
        self.region = next((f for f in reversed(self._regions) if f is not None), None)

    # -- compiled regions ------------------------------------------------------

    def open_frame(self, fqn: str, parent: Frame) -> Frame:
        """A frame for a call of ``fqn`` that no hook saw (a module inside a compiled region,
        named by its graph's ``nn_module_stack``): the next call of that name in the step, a
        child of ``parent``, found by backward ops and recompute like a hooked call."""
        frame = Frame(fqn, self._next_call(fqn), parent)
        parent.children.setdefault(fqn, []).append(frame)
        self._last_call[fqn] = frame
        return frame

    @contextmanager
    def speaking_for(self, frame: Frame) -> Iterator[None]:
        """Ops routed inside belong to ``frame`` (as an engine region's do), whatever runs."""
        self._regions.append(frame)
        self.region = frame
        try:
            yield
        finally:
            self.exit_region()

    # -- per-op queries --------------------------------------------------------

    def locate(self) -> tuple[str, Frame]:
        """The phase of the op about to run and the frame it belongs to."""
        if self._optimizer is not None:
            return "optimizer", self._optimizer
        if _current_graph_task_id() == -1:
            return "forward", self.stack[-1] if self.stack else self.outside
        if self.stack and self.stack[-1].recompute:
            return "recompute", self.stack[-1]
        node = _current_autograd_node()
        if node is None:
            return "backward", self.outside
        seq = node._sequence_nr()
        frame = self._seq_frames.get(seq)
        # torch.utils.checkpoint re-runs a forward inside backward under its recomputation
        # hooks (spelled out, not a helper call: this runs for every backward op).
        hooks = _top_saved_tensors_hooks(False) if _top_saved_tensors_hooks is not None else None
        if hooks is not None and "_recomputation_hook" in getattr(hooks[0], "__qualname__", ""):
            return "recompute", frame or self.outside
        if frame is None and seq == _ACCUMULATE_GRAD_SEQ:
            frame = self._param_frame(node)
        return "backward", frame or self.outside

    def note_autograd_node(self, frame: Frame) -> None:
        """After a forward op: remember which frame created the newest autograd node.

        ``setdefault`` keeps the first claimant: an op that created no node sees
        the number of an earlier op's node, which that op already claimed. With
        grad mode off no op creates a node.
        """
        if _is_grad_enabled():
            self._seq_frames.setdefault(_get_sequence_nr() - 1, frame.origin)

    def _param_frame(self, node: Any) -> Frame | None:
        variable = getattr(node, "variable", None)
        if variable is None:
            return None
        owner = self.names.param_owner(variable)
        return self._last_call.get(owner) if owner is not None else None
