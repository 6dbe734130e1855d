"""Frames of the probe's that dynamo must never compile.

The eager code between a ``torch.compile``d model's graphs (``compiled="keep"``) runs with dynamo's
frame callback on, and every Python frame entered from it is a frame dynamo may compile: the
dispatch handler the ops there call, the module hooks their calls fire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def never_compiled(fn: F) -> F:
    """Marks ``fn`` (a function torch calls back: the dispatch handler, a module hook) so that
    dynamo never compiles its frame nor any frame it calls, and returns it. The eager code between
    a ``torch.compile``d model's graphs runs with dynamo's frame callback on, so the probe's
    handler called from there was compiled piecewise (its statistics recompiled per guard until
    the limit, its module hooks compiled with ``is_compiling()`` folded to True: no-ops). The
    mark lives on the code object and is read by dynamo's C frame hook: no cost per call, where
    ``torch.compiler.disable``'s wrapper costs microseconds."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
        from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except Exception:  # pragma: no cover - another torch: its callback is left as it is
        return fn
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is not None:
        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn
