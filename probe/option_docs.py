"""The option table of ``docs/options.md``, generated from the configs' fields.

Each common option (:class:`~probe.vocabulary.session_options.Options`) and each registered mode's
option (its config, :mod:`probe.modes.config`) is one row: name, default, what it accepts (its
check) and its doc line, all read from the field. ``python -m probe.option_docs`` rewrites the
page; ``tests/test_mode_configs.py`` fails when the page and the fields disagree.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import probe.modes  # noqa: F401  (registers the built-in modes and their configs)
from probe.modes.config import CONFIGS
from probe.vocabulary.option_fields import default_of, option_specs
from probe.vocabulary.session_options import Options

PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
_HEAD = """# Options

Generated from the config dataclasses by `python -m probe.option_docs` (do not edit by hand;
`tests/test_mode_configs.py` checks it). A mode's options are the fields of its config
(`probe.Stats(...)`, `probe.Monitor(...)`, ...); the same names are keyword options of
`probe.mode(...)` and keys of a JSON `config=` file, where a keyword goes to every selected mode
that declares it. Two modes may declare the same name: given as configs, each keeps its own value.
"""


def _default(f: dataclasses.Field[Any]) -> str:
    value = default_of(f)
    if hasattr(value, "globs") or hasattr(value, "ranges"):  # Patterns(None), IntSet(None): all
        return "all"
    if isinstance(value, frozenset):
        return ", ".join(sorted(value)) or "none"
    if isinstance(value, tuple) and value and not isinstance(value[0], str):  # parsed structures
        return "(see meaning)"
    text = repr(value).replace("torch.", "torch.")
    return f"`{text}`" if len(text) <= 40 else "(see meaning)"


def option_table(config: type) -> str:
    """The markdown table of the options of ``config`` (a config dataclass), one row each."""
    rows = ["| option | default | accepts | meaning |", "| --- | --- | --- | --- |"]
    for name, (f, spec) in option_specs(config).items():
        rows.append(f"| `{name}` | {_default(f)} | {spec.check.accepts} | {spec.doc} |")
    return "\n".join(rows) + "\n"


def options_page() -> str:
    """The whole of ``docs/options.md``."""
    parts = [_HEAD, "## Common options (`probe.mode(..., out=..., steps=...)`)\n", option_table(Options)]
    for name in sorted(CONFIGS):
        config = CONFIGS[name]
        if not config.__module__.startswith("probe.modes."):
            continue  # a mode defined outside the package (a test's) is not documented here
        title = f"## `{name}`: `probe.{config.__name__}(...)`\n"
        body = option_table(config) if option_specs(config) else "No options of its own.\n"
        parts += [title, (config.__doc__ or "").strip() + "\n", body]
    return "\n".join(parts)


if __name__ == "__main__":
    PAGE.write_text(options_page())
    sys.stdout.write(f"wrote {PAGE}\n")
