"""torch's warnings about the probe's own hooks, which the user can do nothing about.

The module tracker's global forward hooks make torch warn at every call of a
``torch.compile``d module (``OptimizedModule.__call__``: "Using `torch.compile(module)` when
there are global hooks on modules ..."). The hooks are the probe's, not the user's, and the
extra hook call torch warns of is the compiled wrapper's own call: one more module frame around
its module's (the root, when ``model=`` does not name the module: then modules are named as the
wrapper's state dict names them, ``_orig_mod.*``). Under a warnings filter that makes warnings errors
(``warnings.simplefilter("error")``, pytest's ``filterwarnings = error``) that warning stopped
training at the compiled model's first call. While the hooks are installed that one warning is
ignored; every other warning is left to the program's filters.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

COMPILED_MODULE_NOTICE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""The start of torch's warning (a regular expression, as ``warnings`` filters take)."""


def ignore_compiled_module_notice() -> Callable[[], None]:
    """Ignore :data:`COMPILED_MODULE_NOTICE` from now on; the returned call stops ignoring it.

    The filter goes first in ``warnings.filters``, ahead of the program's filters set before
    (a filter set later, inside the session, comes first and wins)."""
    before = list(warnings.filters)
    warnings.filterwarnings("ignore", message=COMPILED_MODULE_NOTICE, category=UserWarning)
    entry = warnings.filters[0]
    if entry in before:  # the program ignores it already: its filter stays as it was
        return lambda: None

    def restore() -> None:
        with contextlib.suppress(ValueError):  # gone already (a catch_warnings block that ended)
            warnings.filters.remove(entry)
        # What filterwarnings calls too: cached decisions of the removed filter are forgotten.
        mutated = getattr(warnings, "_filters_mutated", None)
        if mutated is not None:
            mutated()

    return restore
