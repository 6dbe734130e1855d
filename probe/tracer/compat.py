"""Torch internals the tracer relies on, probed once; missing ones degrade with a warning.

CI tests torch 2.13. Older releases (>= 2.3) lack some of these; each missing
piece turns off one capability with a single warning, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from probe.errors import warn_once
from probe.tracer.compiled_regions import compiled_regions_recorded


def _dynamo_stance_api():
    try:
        from torch._dynamo import eval_frame
    except Exception:  # pragma: no cover - dynamo unavailable
        return None
    if not hasattr(eval_frame, "_set_stance") or not hasattr(torch.compiler, "set_stance"):
        return None
    return eval_frame


@contextmanager
def compiled_regions_eager(policy: str, ran_eagerly: Callable[[], None] | None = None) -> Iterator[None]:
    """While active, ``torch.compile``d code runs eagerly so the tracer sees every op.

    ``policy == "keep"`` leaves compiled code compiled: each call of a compiled graph is
    recorded as one region op (probe.tracer.compiled_regions), as its fused kernels are
    invisible to a dispatch mode; ops it falls back to eager for stay visible.

    ``ran_eagerly`` is called each time a compiled region is entered and runs eagerly instead
    (the session counts them per step: a run must say that its compiled code was not observed).
    """
    if policy == "keep":
        with compiled_regions_recorded():
            yield
        return
    eval_frame = _dynamo_stance_api()
    if eval_frame is None:
        warn_once("stance", "this torch has no torch.compiler.set_stance; compiled "
                  "regions stay compiled and their fused kernels are not traced")
        yield
        return
    prior = eval_frame._stance
    torch.compiler.set_stance("force_eager")
    restore = _say_when_a_compiled_region_runs_eagerly(eval_frame, ran_eagerly)
    try:
        yield
    finally:
        restore()
        eval_frame._set_stance(prior)


_FORCE_EAGER_MESSAGE = ("compiled regions run eagerly while the probe is active, so that no op "
                        "escapes; pass compiled='keep' to leave them compiled")


def _say_when_a_compiled_region_runs_eagerly(
    eval_frame: Any, ran_eagerly: Callable[[], None] | None = None
) -> Callable[[], None]:
    """Warn (once) when a ``torch.compile``d region is entered and runs eagerly, not before:
    most sessions never meet one; call ``ran_eagerly`` each time. Dynamo asks
    ``_callback_from_stance`` for the frame callback on entering a compiled region; under
    ``force_eager`` it answers None. Returns the undo."""
    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None:  # another torch: say it up front rather than never
        warn_once("force_eager", _FORCE_EAGER_MESSAGE)
        return lambda: None

    def callback_from_stance(callback: Any) -> Any:
        if callback is not None and callback is not False and eval_frame._stance.stance == "force_eager":
            warn_once("force_eager", _FORCE_EAGER_MESSAGE)
            if ran_eagerly is not None:
                ran_eagerly()
        return original(callback)

    eval_frame._callback_from_stance = callback_from_stance

    def restore() -> None:
        eval_frame._callback_from_stance = original

    return restore


@contextmanager
def default_compile_stance() -> Iterator[None]:
    """Let the probe's own compiled kernels run compiled under ``force_eager``."""
    eval_frame = _dynamo_stance_api()
    if eval_frame is None or eval_frame._stance.stance == "default":
        yield
        return
    prior = eval_frame._set_stance(eval_frame.DynamoStance())
    try:
        yield
    finally:
        eval_frame._set_stance(prior)


def check_dispatch_features() -> None:
    """Warn (once) about dispatch-mode features this torch lacks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        warn_once("ignore_compile_internals", "this torch cannot tell torch.compile to ignore "
                  "the probe; a function compiled while it is active may be recompiled")
    if not hasattr(torch._C, "_current_graph_task_id"):
        warn_once("graph_task", "this torch cannot tell backward from forward; every op "
                  "is labelled forward")
    if not hasattr(torch._C._autograd, "_get_sequence_nr"):
        warn_once("sequence_nr", "this torch cannot link backward ops to the module whose "
                  "forward created them; backward ops are attributed to no module")
