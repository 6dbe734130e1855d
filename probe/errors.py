"""The probe's exception and warning types, and the one way to warn once."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch


class ProbeError(Exception):
    """A bad option, unreadable input or unusable output location.

    Raised before any op is traced; the message names the offending value and
    what would have been accepted.
    """


class ProbeWarning(UserWarning):
    """Something the probe cannot do on this setup, said once."""


_warned: set[str] = set()


_OWN_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def warn_once(key: str, message: str) -> None:
    """Warn once per process, attributed to the user's line that led here."""
    if key in _warned:
        return
    _warned.add(key)
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame = frame.f_back
    registry = frame.f_globals.setdefault("__warningregistry__", {})
    warnings.warn_explicit(
        f"probe: {message}", ProbeWarning, frame.f_code.co_filename, frame.f_lineno,
        module=frame.f_globals.get("__name__"), registry=registry,
    )
