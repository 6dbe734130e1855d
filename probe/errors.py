"""The probe's exception and warning types, and the one way to warn once."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings


class ProbeError(Exception):
    """A bad option, unreadable input or unusable output location.

    Raised before any op is traced; the message names the offending value and
    what would have been accepted.
    """


class ProbeWarning(UserWarning):
    """Something the probe cannot do on this setup, said once."""


_warned: set[str] = set()


def _own_dirs() -> tuple[str, ...]:
    """The directories of the frames :func:`warn_once` walks past: the probe's, contextlib's and
    torch's (looked up when warning, so that importing this module imports no torch)."""
    modules = [sys.modules[__name__], contextlib, sys.modules.get("torch")]
    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                 for m in modules if m is not None and getattr(m, "__file__", None))


log = logging.getLogger("probe")
"""Where a warning goes that the warnings filter would have raised (see :func:`warn_once`)."""


def warn_once(key: str, message: str) -> None:
    """Warn once per process, attributed to the user's line that led here. Never raises.

    The probe warns from inside the user's training (``session.step()``, the end of a ``with``
    block, an op): a warnings filter that turns warnings into errors
    (``warnings.simplefilter("error")``, pytest's ``filterwarnings = error``) would make the
    warning an exception there and stop training. Then the warning is logged instead, on the
    ``probe`` logger at WARNING level (printed to stderr where logging is not configured), and
    training goes on. Filters that ignore it are obeyed.
    """
    if key in _warned:
        return
    _warned.add(key)
    frame = sys._getframe(1)
    own_dirs = _own_dirs()
    while frame.f_back is not None and frame.f_code.co_filename.startswith(own_dirs):
        frame = frame.f_back
    text = f"probe: {message}"
    try:
        registry = frame.f_globals.setdefault("__warningregistry__", {})
        warnings.warn_explicit(
            text, ProbeWarning, frame.f_code.co_filename, frame.f_lineno,
            module=frame.f_globals.get("__name__"), registry=registry,
        )
    except Exception as raised:  # the "error" action, or a showwarning that raises
        with contextlib.suppress(Exception):  # a handler of the user's that raises, too
            log.warning("%s [%s:%d; logged, not raised: the warnings filter makes it an error (%s), "
                        "which would stop training]", text, frame.f_code.co_filename, frame.f_lineno,
                        type(raised).__name__)
