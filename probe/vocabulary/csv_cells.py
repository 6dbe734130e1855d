"""A CSV cell as a spreadsheet shows it: every CSV the probe writes (compare reports, the start
checks of two runs) escapes its cells with :func:`csv_safe`."""

from __future__ import annotations

_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(text: str) -> str:
    """``text`` as a spreadsheet shows it, never as a formula: a leading = + - @ tab or CR
    gets a quote in front (OWASP's CSV-injection rule), except plain numbers such as -0.5."""
    if text.startswith(_FORMULA_STARTS):
        try:
            float(text)
        except ValueError:
            return "'" + text
    return text
