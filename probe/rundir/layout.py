"""Where things live in a run directory: the files every run has. A mode's own files are named in
its package (``probe.modes.stats.file_names``, ``probe.modes.dump.file_names``,
``probe.modes.monitor.file_names``, ``CHECKS_FILE`` and ``CHECKSUMS_FILE`` in the free benchmark's
and the checksums' ``files``), which its reader declares (``ModeFiles.file_names``).

See docs/format.md for the full description; bump FORMAT_VERSION on any change
a reader of an older version could misread.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_NAME = "probe-run"
FORMAT_VERSION = 4
"""2: per-tensor distribution shares and histograms, fp8 scales (stats mode), monitor distribution
files. Version-1 runs read the same, without them. 3: ``stats.npy`` counts +Inf and -Inf apart
(columns ``posinf``, ``neginf``); older runs read with those None where a tensor held an Inf.
4: one name per statistic: ``monitor.csv`` names its counts ``nan``, ``inf`` (``nans``, ``infs``
before, still read) and adds ``posinf``, ``neginf``; alerts name ``<slot>.nan``/``<slot>.inf``."""

RUN_FILE = "run.json"
RANK_FILE = "rank.json"
MANIFEST_FILE = "manifest.json"
OPS_FILE = "ops.jsonl"
CALLSITES_FILE = "callsites.json"
MODULES_FILE = "modules.json"
LOCK_FILE = ".lock"
"""In each rank directory: the advisory lock of its one writer, naming the holder's host and pid."""
WRITE_FAILURES_FILE = "write_failures.jsonl"
"""In each rank directory: one line per step (or tail) whose files could not be written."""
ESCALATED_KEY = "escalated"
"""Step manifest entry of a step monitor escalation traced (its window, the incidents)."""
ESCALATION_REFUSED_KEY = "escalation_refused"
"""Step manifest entry of the step at whose start incidents were learned but not traced."""
COMPILED_EAGER_KEY = "compiled_ran_eagerly"
"""Step manifest entry (compiled="eager"): how many times a ``torch.compile``d region was entered
and ran eagerly in the step; absent when none was. The numerics of compiled code were not observed."""
COMPILED_OPENED_KEY = "compiled_regions_opened"
"""Step manifest entry (compiled="keep"): compiled region op id -> ``[first, end)``, the indices of
the ops its graph's node-by-node re-run recorded, in the modules they came from; absent when none."""
COMPILED_FILES_KEY = "compiled_region_files"
"""Step manifest entry (compiled="keep"): compiled region op id -> ``{"graph": name, "tensors":
path or null}``, its graph's files in ``rank<r>/compiled/`` and its recorded inputs and compiled
outputs (``probe.rundir.region_graphs``); absent when none was written."""
AUTOCAST_KEY = "autocast"
"""Step manifest entry: the autocast policies the step's forward ops ran under, by the id their
records hold (``amp``): each ``{device type: dtype}`` autocast was enabled for, ``{}`` when it was
off (``probe.tracer.autocast_policy``). Absent in runs written before it: their ops' policy is not
known."""
MODE_FAILURES_KEY = "mode_failures"
"""Step manifest entry: mode name -> where its per-op work first raised and what (``"ValueError at
forward:fc[0]:aten.mm.default:0: ..."``). The mode was detached there so that training went on;
from that op on the step holds none of its data (its ops read as not measured, never as a pass).
Absent when every mode ran to the end."""
UNTRACED_THREADS_KEY = "untraced_threads"
"""Step manifest entry: thread name -> module and optimizer calls on that thread in the step,
which the probe's dispatch mode did not see (a dispatch mode is per thread): their ops are not in
the step's records. Absent when every call ran on a traced thread."""

_RANK_RE = re.compile(r"rank(\d+)")
_STEP_RE = re.compile(r"step(\d+)")
_PARTIAL_RE = re.compile(r"\.step(\d+)\.partial")
_TAIL_RE = re.compile(r"tail(\d+)")


def rank_dir(out: Path, rank: int) -> Path:
    return out / f"rank{rank}"


def step_dir(out: Path, rank: int, step: int) -> Path:
    return rank_dir(out, rank) / f"step{step}"


def partial_step_dir(out: Path, rank: int, step: int) -> Path:
    """Where a step is written before the rename that makes it visible."""
    return rank_dir(out, rank) / f".step{step}.partial"


def tail_dir(out: Path, rank: int, step: int) -> Path:
    """What was recorded after the last ``session.step()`` (numbered as the step it would have
    been): a name :func:`list_steps` does not count, so ``Run.steps`` needs no manifest to skip it."""
    return rank_dir(out, rank) / f"tail{step}"


def partial_tail_dir(out: Path, rank: int, step: int) -> Path:
    return rank_dir(out, rank) / f".tail{step}.partial"


def list_ranks(out: Path) -> list[int]:
    found = []
    for entry in out.iterdir():
        m = _RANK_RE.fullmatch(entry.name)
        if m and entry.is_dir():
            found.append(int(m.group(1)))
    return sorted(found)


def list_steps(out: Path, rank: int) -> tuple[list[int], list[int]]:
    """(flushed steps, steps whose flush never finished) of one rank."""
    flushed, unfinished = [], []
    directory = rank_dir(out, rank)
    for entry in directory.iterdir():
        if m := _STEP_RE.fullmatch(entry.name):
            flushed.append(int(m.group(1)))
        elif m := _PARTIAL_RE.fullmatch(entry.name):
            unfinished.append(int(m.group(1)))
    return sorted(flushed), sorted(unfinished)


def list_tails(out: Path, rank: int) -> list[int]:
    """The step numbers of the committed tails of one rank (one per session, so at most one)."""
    return sorted(int(m.group(1)) for entry in rank_dir(out, rank).iterdir()
                  if (m := _TAIL_RE.fullmatch(entry.name)))


def is_probe_entry(name: str) -> bool:
    """Entries a run directory may hold (``run.json``, its temporary files, rank directories)."""
    return (name == RUN_FILE or _RANK_RE.fullmatch(name) is not None
            or (name.startswith(f".{RUN_FILE}.") and name.endswith(".tmp")))
