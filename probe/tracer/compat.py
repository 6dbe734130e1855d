"""Torch internals the tracer relies on, probed once; missing ones degrade with a warning.

CI tests torch 2.13. Older releases (>= 2.3) lack some of these; each missing
piece turns off one capability with a single warning, never a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from probe.errors import warn_once


def _dynamo_stance_api():
    try:
        from torch._dynamo import eval_frame
    except Exception:  # pragma: no cover - dynamo unavailable
        return None
    if not hasattr(eval_frame, "_set_stance") or not hasattr(torch.compiler, "set_stance"):
        return None
    return eval_frame


@contextmanager
def compiled_regions_eager(policy: str) -> Iterator[None]:
    """While active, ``torch.compile``d code runs eagerly so the tracer sees every op.

    ``policy == "keep"`` leaves compiled code compiled (its fused kernels are
    invisible to a dispatch mode; ops it falls back to eager for stay visible).
    """
    eval_frame = _dynamo_stance_api() if policy == "eager" else None
    if eval_frame is None:
        if policy == "eager":
            warn_once("stance", "this torch has no torch.compiler.set_stance; compiled "
                      "regions stay compiled and their fused kernels are not traced")
        yield
        return
    prior = eval_frame._stance
    torch.compiler.set_stance("force_eager")
    warn_once("force_eager", "compiled regions run eagerly while the probe is active, so "
              "that no op escapes; pass compiled='keep' to leave them compiled")
    try:
        yield
    finally:
        eval_frame._set_stance(prior)


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
