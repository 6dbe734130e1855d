"""Missing data is never agreement: what a compare cannot read, it says it did not compare.

- A step unreadable in both runs (a disk fault shared by both copies, or a run compared with
  itself) has no op rows to mark: the report still names it, ``report.ok`` is False and
  ``probe compare --fail-on-divergence`` exits 1. Before: ``ok`` was True and the conclusion
  "every matched op compared clean", the step dropped without a word.
- A damaged first manifest (``step0/manifest.json`` cut short) in either run costs that step
  only. Before: the compare ended with exit 2 and compared nothing.
- A safetensors shard whose ``data_offsets`` overlap, leave a gap or reach past its file is
  refused as ``safetensors`` refuses it, and its tensors are "not compared", naming the file.
  Before: the probe read aliased bytes and reported "error" ops.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors
import torch
from conftest import SharedBlockNet, train_steps

import probe
from probe import ProbeError, cli
from probe.analysis.verdicts import NOT_COMPARED, PASS
from probe.modes.dump.file_names import TENSOR_INDEX_FILE, tensors_dir
from probe.rundir import layout
from probe.vocabulary.op_class import creates_uninitialized

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two runs of one training (statistics and dump), each step a shard or more of tensors."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = SharedBlockNet()
        with probe.mode(["stats", "dump"], out=root / name, model=model) as session:
            train_steps(model, STEPS, session=session)
    return root / "a", root / "b"


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


# -- a step no run can read -----------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["two damaged copies", "a run with itself"])
def test_a_step_unreadable_in_both_runs_is_not_agreement(runs, tmp_path, capsys, pair):
    a = _copy(runs[0], tmp_path / "a")
    b = a if pair == "a run with itself" else _copy(runs[1], tmp_path / "b")
    for run in {a, b}:
        _cut_short(layout.step_dir(run, 0, 1) / layout.MANIFEST_FILE)
    report = probe.compare(a, b, steps=[0, 1])
    assert not report.ok
    (unread,) = report.unreadable
    assert (unread.step, unread.rank) == (1, 0)
    assert "run A: unreadable" in unread.unreadable and "run B: unreadable" in unread.unreadable
    assert layout.MANIFEST_FILE in unread.unreadable
    assert "1 step(s) not compared, unreadable: step 1 rank 0" in report.conclusion
    assert report.summary["unreadable"][0]["step"] == 1 and not report.summary["ok"]
    assert {row["verdict"] for row in report.rows if row["step"] == 0} == {PASS}

    capsys.readouterr()
    assert cli.main(["compare", "--steps", "0,1", str(a), str(b), "--fail-on-divergence"]) == 1
    printed = " ".join(capsys.readouterr().out.split())
    assert "not compared: step 1 rank 0, run A: unreadable" in printed and layout.MANIFEST_FILE in printed
    assert "first divergence: none among the ops compared" in printed


# -- the first manifest ---------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["A", "B"])
def test_a_damaged_first_manifest_costs_that_step_only(runs, tmp_path, capsys, side):
    damaged = _copy(runs[0 if side == "A" else 1], tmp_path / "damaged")
    manifest = layout.step_dir(damaged, 0, 0) / layout.MANIFEST_FILE
    _cut_short(manifest)
    a, b = (damaged, runs[1]) if side == "A" else (runs[0], damaged)
    report = probe.compare(a, b, steps=[0, 1])
    by_step = {s.step: s for s in report.steps}
    assert by_step[0].unreadable is not None and f"run {side}: unreadable" in by_step[0].unreadable
    assert str(manifest) in by_step[0].unreadable
    step0 = [row for row in report.rows if row["step"] == 0]
    assert step0 and {row["verdict"] for row in step0} == {NOT_COMPARED}
    assert by_step[1].unreadable is None
    assert {row["verdict"] for row in report.rows if row["step"] == 1} == {PASS}
    assert not report.ok
    # The initial weights are recorded at step 0: the report says why they were not compared.
    weights = report.identity.checks[0]
    assert weights.status == "not recorded"
    assert f"step 0 rank 0 of run {side} could not be read" in weights.message

    capsys.readouterr()
    assert cli.main(["compare", "--steps", "0,1", str(a), str(b)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert f"not compared: step 0 rank 0, run {side}: unreadable" in printed


# -- safetensors shards whose data_offsets do not tile their data ---------------------------------


def _rewrite_header(shard: Path, change: Callable[[dict], None]) -> None:
    """Change the shard's header in place, keeping its length (the data stays where it was)."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    shard.write_bytes(data[:8] + encoded.ljust(length) + data[8 + length :])


def _blobs(header: dict) -> list[dict]:
    return sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda v: v["data_offsets"])


def _all_at_0(header: dict) -> None:
    for blob in _blobs(header):
        begin, end = blob["data_offsets"]
        blob["data_offsets"] = [0, end - begin]


def _past_the_end(header: dict) -> None:
    last = _blobs(header)[-1]
    last["data_offsets"][1] += 4096
    last["shape"] = [last["data_offsets"][1] - last["data_offsets"][0]]


def _a_gap(header: dict) -> None:
    first = _blobs(header)[0]
    first["data_offsets"][0] += 64
    first["shape"] = [first["data_offsets"][1] - first["data_offsets"][0]]


OFFSET_DAMAGE = {"all at 0 (overlapping)": (_all_at_0, "overlaps"),
                 "past the end of the file": (_past_the_end, "past the end of the file"),
                 "a gap before the first": (_a_gap, "leaves bytes 0-64 in no tensor")}


@pytest.mark.parametrize("kind", OFFSET_DAMAGE)
def test_a_shard_whose_data_offsets_do_not_tile_it_is_refused_and_not_compared(runs, tmp_path, kind):
    damaged = _copy(runs[1], tmp_path / "b")
    shard = tensors_dir(damaged, 0, 0) / "shard-00000.safetensors"
    change, message = OFFSET_DAMAGE[kind]
    _rewrite_header(shard, change)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type differs by version
        safetensors.safe_open(str(shard), "pt")  # the refusal the probe makes too

    run = probe.load(damaged)
    index = json.loads((layout.step_dir(damaged, 0, 0) / TENSOR_INDEX_FILE).read_text())
    in_shard = {int(blob) for blob, (name, _) in index["blobs"].items() if name == shard.name}
    affected = [e for e in index["tensors"] if e["blob"] in in_shard and e["io"] == "output"]
    assert affected
    first = affected[0]
    op = run.ops(0)[first["op"]]
    with pytest.raises(ProbeError, match=message) as refused:
        run.tensor(op.id, first["io"], first["position"], step=0)
    assert shard.name in str(refused.value)

    report = probe.compare(runs[0], damaged, steps=[0])
    rows = {row["op_b"]: row for row in report.rows}
    for entry in affected:
        op = run.ops(0)[entry["op"]]
        row = rows[op.id]
        if creates_uninitialized(op.name):  # no value of the program: compared by shape, by design
            continue
        assert row["verdict"] == NOT_COMPARED, row
        assert shard.name in row["message"] and "run B" in row["message"]
    assert report.counts["error"] == 0 and not report.ok
