"""Charts of a run and the files they go to, drawn with matplotlib (the ``plot`` extra).

Matplotlib is imported when a chart is drawn, never at import time: without it the rest of
the probe works, the compare page says how to get its chart and ``probe summary --plot``
refuses with the same line (:data:`INSTALL_HINT`). The compare page's own chart
(:func:`error_chart`) and the shared chart settings live in
:mod:`probe.exporters.compare_report`, which imports nothing of the probe; they are
re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from probe.errors import ProbeError
from probe.exporters.compare_report import (
    INSTALL_HINT,
    chart_style,
    error_chart,
    inline_svg,
    matplotlib_available,
    mpl_text,
    new_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from probe.analysis.summary import ModuleMagnitude

__all__ = ["FORMATS", "INSTALL_HINT", "available", "check_format", "error_chart", "inline_svg",
           "module_chart", "require", "save"]

FORMATS = (".png", ".svg")
"""The files :func:`save` writes, by extension."""
_PHASE_COLOURS = {"forward": "#1e88e5", "backward": "#fb8c00", "recompute": "#8e24aa", "optimizer": "#6d4c41"}
_NONFINITE = "#e53935"


def available() -> bool:
    """Whether matplotlib can be imported (the ``plot`` extra is installed)."""
    return matplotlib_available()


def require(what: str) -> None:
    """Raise :class:`ProbeError` naming ``what`` and :data:`INSTALL_HINT` when matplotlib is missing."""
    if not available():
        raise ProbeError(f"{what} needs matplotlib, which is not installed: {INSTALL_HINT}")


def check_format(path: str | Path, option: str = "--plot") -> str:
    """The format ``path``'s extension names ("png" or "svg"); a :class:`ProbeError` naming it otherwise."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ProbeError(f"{option} {str(path)!r}: unknown extension {suffix or '(none)'!r}; "
                         f"give a file ending in {' or '.join(FORMATS)}")
    return suffix[1:]


def save(figure: Figure, path: str | Path) -> Path:
    """Write ``figure`` as PNG or SVG, by ``path``'s extension (:func:`check_format`)."""
    path = Path(path)
    fmt = check_format(path)
    with chart_style():
        # No creation date: the same run gives the same file.
        metadata = {"Date": None} if fmt == "svg" else {"Software": None}
        figure.savefig(path, format=fmt, metadata=metadata, dpi=150, bbox_inches="tight")
    return path


# -- summary: magnitudes per module ------------------------------------------------------


def module_chart(magnitudes: Sequence[ModuleMagnitude], title: str = "") -> Figure:
    """Per module (in order of first execution, top to bottom), its largest output magnitude
    in each phase as bars on a log scale; modules that made a NaN or Inf are marked.

    ``magnitudes``: :func:`probe.analysis.summary.module_magnitudes`.
    """
    phases = [p for p in _PHASE_COLOURS if any(p in m.largest or p in m.nonfinite for m in magnitudes)]
    phases += sorted({p for m in magnitudes for p in (*m.largest, *m.nonfinite)} - set(phases))
    n = max(len(magnitudes), 1)
    figure = new_figure(9, min(0.16 * n * max(len(phases), 1) ** 0.5 + 1.4, 120))
    with chart_style():
        ax = figure.add_subplot()
        height = 0.8 / max(len(phases), 1)
        values = [v for m in magnitudes for v in m.largest.values() if v > 0]
        low = 10.0 ** math.floor(math.log10(min(values))) if values else 1e-3
        high = max(values) if values else 1.0
        for k, phase in enumerate(phases):
            ys = [i - 0.4 + height * (k + 0.5) for i in range(len(magnitudes))]
            widths = [m.largest.get(phase, 0.0) for m in magnitudes]
            ax.barh(ys, [max(w, low) - low / 2 if w > 0 else 0 for w in widths], height=height * 0.9,
                    left=low / 2, color=_PHASE_COLOURS.get(phase, "#757575"), label=phase)
            bad = [(y, m) for y, m in zip(ys, magnitudes, strict=True) if m.nonfinite.get(phase)]
            if bad:
                ax.scatter([high * 3] * len(bad), [y for y, _ in bad], marker="X", s=28, color=_NONFINITE,
                           zorder=3, label=f"NaN/Inf ({phase})")
        ax.set_yticks(range(len(magnitudes)),
                      [mpl_text(m.module or "<outside modules>") for m in magnitudes],
                      fontsize=7 if len(magnitudes) < 60 else 5)
        ax.set_ylim(len(magnitudes) - 0.5, -0.5)  # execution order, top to bottom
        ax.set_xscale("log")
        ax.set_xlim(low / 2, high * 10)
        ax.set_xlabel("largest |output| of the module's ops (finite values; masks excluded)")
        ax.set_axisbelow(True)
        ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
        ax.legend(loc="lower left", bbox_to_anchor=(1.0, 0.0), fontsize=7, frameon=False)
        if title:
            ax.set_title(mpl_text(title), loc="left", fontsize=9)
    return figure
