"""Ops after the last ``session.step()``: a tail beside the steps, not a step of its own; the last,
incomplete step of a block that raises; a session without ``step()`` calls is one step."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SharedBlockNet, train_steps

import probe
from probe.rundir import layout


def test_ops_after_the_last_step_are_a_tail_not_a_step(tmp_path):
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("stats", out=out) as session:
        losses, _ = train_steps(model, 3, session=session)
        losses[-1].item()
    run = probe.load(out)
    assert run.steps == [0, 1, 2] and run.unfinished_steps == []
    tail = layout.tail_dir(out, 0, 3)
    manifest = json.loads((tail / layout.MANIFEST_FILE).read_text())
    assert manifest["tail"] is True and manifest["complete"] is True and manifest["ops"] == 1
    (record,) = [json.loads(line) for line in (tail / layout.OPS_FILE).read_text().splitlines()]
    assert record["name"] == "aten._local_scalar_dense.default"


def test_ops_after_the_last_step_of_a_block_that_raises_are_its_last_incomplete_step(tmp_path):
    out = tmp_path / "run"
    torch.manual_seed(0)
    model = SharedBlockNet()
    with pytest.raises(RuntimeError, match="after the loop"), probe.mode("stats", out=out) as session:
        losses, _ = train_steps(model, 2, session=session)
        losses[-1].item()
        raise RuntimeError("after the loop")
    run = probe.load(out)
    assert run.steps == [0, 1, 2]
    assert not run.step_info(2).complete and len(run.ops(2)) == 1
    assert not layout.tail_dir(out, 0, 2).exists()


def test_a_session_without_step_calls_records_one_step(tmp_path):
    with probe.mode("stats", out=tmp_path / "run"):
        torch.ones(3).sum().item()
    run = probe.load(tmp_path / "run")
    assert run.steps == [0] and len(run.ops(0)) == 3
