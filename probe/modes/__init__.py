"""What probe does with what it traces: the modes, each a subpackage that owns its plug-in and
writer (``mode``), its reader (``files``), its config (``options``: ``probe.Stats``, ...) and its
helpers.

Per-op modes observe ops through the tracer's dispatch mode: ``stats``, ``dump``,
``free_benchmark``, ``upcast``, ``structure``. The monitor family (``monitor``) works from module
and optimizer hooks alone and enters no dispatch mode; ``checksums`` likewise. ``statistics`` is
the one statistics engine they share (capture queue, column table, reducers, finalize,
distributions). ``base`` says what a mode is, ``config`` what a mode's config is, ``sinks`` where
its live series go (the session offers them, the exporters implement them), ``registry`` names
them; the run reader finds each mode's reader through the registry. Importing this package
registers the built-in modes.
"""

from probe.modes import (  # noqa: F401  (register them)
    checksums,
    dump,
    free_benchmark,
    monitor,
    recipes,
    stats,
    structure,
    upcast,
)
from probe.modes.base import Mode
from probe.modes.config import CONFIGS, ModeConfig
from probe.modes.registry import MODES, register_mode

__all__ = ["CONFIGS", "MODES", "Mode", "ModeConfig", "register_mode"]
