"""The stats mode's files in a step directory (its own: no module outside ``probe/modes/stats``
names them; docs/format.md describes them)."""

from __future__ import annotations

STATS_FILE = "stats.npy"
"""One statistics row per recorded value (the columns of ``files.STAT_NAMES``)."""
STATS_INDEX_FILE = "stats_index.npy"
"""Rows of (op index, input 0 / output 1, position, stats row)."""
DISTRIBUTION_FILE = "distribution.npy"
"""distribution=True: shares of zeros, underflow, near-overflow per stats row."""
HISTOGRAM_FILE = "histogram.npy"
"""histogram=True: (stats row, binary exponent, count) entries."""
SKETCH_FILE = "sketch.npy"
"""sketch=True: random-sign projections per stats row (``statistics.sketch``), NaN where none."""
FP8_SCALES_FILE = "fp8_scales.jsonl"
"""The scales fp8 ops were given, one object per op."""

FILE_NAMES = (STATS_FILE, STATS_INDEX_FILE, DISTRIBUTION_FILE, HISTOGRAM_FILE, SKETCH_FILE, FP8_SCALES_FILE)
