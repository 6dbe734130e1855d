"""The dump's files (its own: no module outside ``probe/modes/dump`` names them; docs/format.md
describes them)."""

from __future__ import annotations

from pathlib import Path

from probe.rundir.layout import rank_dir

TENSOR_INDEX_FILE = "tensors.json"
"""In a step directory: every dumped tensor with its blob, byte offset, dtype, shape and stride."""
CALLS_FILE = "calls.jsonl"
"""In a step directory: each dumped op's call (``{"i", "args", "kwargs"}``)."""
TENSORS_DIR = "tensors"
"""In a rank directory: the safetensors shards, a folder per step (:func:`tensors_dir`)."""

FILE_NAMES = (TENSOR_INDEX_FILE, CALLS_FILE)
"""The dump's files in a step directory (its shards lie beside the steps: :func:`tensors_dir`)."""


def tensors_dir(out: Path, rank: int, step: int) -> Path:
    """Where the dump's shards of one step go (written while the step runs, before the step's
    directory exists)."""
    return rank_dir(out, rank) / TENSORS_DIR / f"step{step}"
