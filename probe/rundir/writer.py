"""Writing a run directory: every file lands complete or not at all.

A step is written into a hidden ``.stepN.partial`` directory, each file fsynced,
then renamed to ``stepN``: a reader sees a whole step or none of it, and a crash
mid-flush leaves only the partial directory, which the reader reports as
unfinished. Every step flushed before a crash stays readable.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.rundir import layout

# One encoder for every row: json.dumps with options builds a new encoder per call.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: Any) -> None:
    # Per process: every rank of a job writes run.json into the same directory.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_file(tmp, json.dumps(obj, indent=1, sort_keys=True).encode())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class StepWriter:
    """Collects the files of one (rank, step) and commits them with one rename."""

    def __init__(self, out: Path, rank: int, step: int) -> None:
        self.out, self.rank, self.step = out, rank, step
        self.directory = layout.partial_step_dir(out, rank, step)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)

    def write_json(self, name: str, obj: Any) -> None:
        _write_file(self.directory / name, _COMPACT_JSON.encode(obj).encode())

    def write_jsonl(self, name: str, rows: Iterable[Any]) -> None:
        encode = _COMPACT_JSON.encode
        lines = "".join([encode(row) + "\n" for row in rows])
        _write_file(self.directory / name, lines.encode())

    def write_text(self, name: str, text: str) -> None:
        _write_file(self.directory / name, text.encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        _write_file(self.directory / name, data)

    def write_array(self, name: str, array: np.ndarray) -> None:
        path = self.directory / name
        with open(path, "wb") as f:
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, manifest: dict[str, Any]) -> Path:
        """Write the manifest last, then make the step visible."""
        manifest = {"format_version": layout.FORMAT_VERSION, "step": self.step, "rank": self.rank,
                    **manifest}
        self.write_json(layout.MANIFEST_FILE, manifest)
        _fsync_dir(self.directory)
        final = layout.step_dir(self.out, self.rank, self.step)
        if final.exists():
            shutil.rmtree(final)
        os.rename(self.directory, final)
        _fsync_dir(final.parent)
        return final


class RunWriter:
    """Creates the run directory and hands out one :class:`StepWriter` per step."""

    def __init__(
        self, out: Path, process: dict[str, Any], overwrite: bool, run_info: dict[str, Any]
    ) -> None:
        """``process``: this rank's :func:`probe.tracer.rank.process_info`."""
        self.out = out
        self.rank = rank = process["rank"]
        out.mkdir(parents=True, exist_ok=True)
        rank_path = layout.rank_dir(out, rank)
        if overwrite:
            # A single process replaces the whole run; a rank of a job only its own
            # directory, as the other ranks are writing theirs.
            replaced = layout.list_ranks(out) if process["world_size"] == 1 else [rank]
            for old in replaced:
                shutil.rmtree(layout.rank_dir(out, old), ignore_errors=True)
        rank_path.mkdir(exist_ok=True)
        write_json_atomic(rank_path / layout.RANK_FILE, process)
        info = {
            "format": layout.FORMAT_NAME,
            "format_version": layout.FORMAT_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch_version": torch.__version__,
            "world_size": process["world_size"],
            **run_info,
        }
        write_json_atomic(out / layout.RUN_FILE, info)

    def step(self, step: int) -> StepWriter:
        return StepWriter(self.out, self.rank, step)
