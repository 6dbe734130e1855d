"""Python call sites of traced ops, captured once per unique site and interned.

Walking to the innermost user frame costs a few attribute reads per frame; the
full stack is extracted only the first time a (module, op, file, line) site is
seen, so a training loop pays the expensive part once per site, not per call.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PROBE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The built-in demo model is user code as far as call sites go.
_DEMO_DIR = os.path.join(_PROBE_DIR, "demo") + os.sep
_MAX_DEPTH = 64


def _is_internal(filename: str) -> bool:
    if filename.startswith(_PROBE_DIR):
        return not filename.startswith(_DEMO_DIR)
    return filename.startswith(_TORCH_DIR) or filename.startswith("<frozen")


class CallSites:
    """Interns call sites; ``capture()`` returns a small int per unique site."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str, int], int] = {}
        self.stacks: list[list[str]] = []
        """Per call-site id: the user-visible stack, outermost first, as ``file:line in func``."""

    def capture(self, module: str) -> int | None:
        frame: FrameType | None = sys._getframe(2)
        depth = 0
        while frame is not None and _is_internal(frame.f_code.co_filename):
            frame = frame.f_back
            depth += 1
            if depth > _MAX_DEPTH:
                return None
        if frame is None:
            return None
        key = (module, frame.f_code.co_filename, frame.f_lineno)
        site = self._ids.get(key)
        if site is None:
            site = len(self.stacks)
            self._ids[key] = site
            self.stacks.append(_user_stack(frame))
        return site


def _user_stack(frame: FrameType | None) -> list[str]:
    lines: list[str] = []
    while frame is not None and len(lines) < _MAX_DEPTH:
        code = frame.f_code
        if not _is_internal(code.co_filename):
            lines.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    lines.reverse()
    return lines
