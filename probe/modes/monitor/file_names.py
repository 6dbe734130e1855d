"""The monitor's files in a step directory (``rankR/stepN/``): its writer and its reader use these
names, and nothing outside the mode does (docs/format.md, "The monitor")."""

from __future__ import annotations

MONITOR_FILE = "monitor.csv"
"""One row per series: kind, name, slot, call and the metrics (``MONITOR_COLUMNS``)."""
ANOMALIES_FILE = "anomalies.jsonl"
"""One alert per line, in detection order."""
MONITOR_DISTRIBUTION_FILE = "monitor_distribution.npy"
"""distribution=True: the shares per series, rows in ``monitor.csv``'s order."""
MONITOR_HISTOGRAM_FILE = "monitor_histogram.npy"
"""histogram=True: (series row, binary exponent, count) entries."""
ANOMALY_TENSORS_FILE = "anomaly_tensors.safetensors"
"""on_anomaly="dump": the tensors of the series that alerted, named ``<name>[<call>].<slot>``."""

FILE_NAMES = (MONITOR_FILE, ANOMALIES_FILE, MONITOR_DISTRIBUTION_FILE, MONITOR_HISTOGRAM_FILE,
              ANOMALY_TENSORS_FILE)
