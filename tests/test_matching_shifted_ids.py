"""Ids number the ops of one name per module call: where one run has an extra op of a name, the
ids of that name are shifted from it on, and those ops are aligned in order instead (up to
``matching.ALIGN_LIMIT`` of them, beyond which alignment costs too much and the ids pair them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import probe
from probe.analysis import matching


class _Clones(nn.Module):
    """Ten clones of a value scaled each time; with ``extra``, first a clone of another value (another
    shape: what an autocast cast of a loss's logits is beside the scalar casts of a loss scaler)."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra:
            x = x + x.new_ones(2, 2).clone().sum()
        for _ in range(10):
            x = (x * 1.5).clone()
        return x


def _ops(tmp_path: Path) -> tuple[list, list]:
    runs = []
    for name, extra in (("a", False), ("b", True)):
        model = _Clones(extra)
        with probe.mode("stats", out=tmp_path / name, model=model) as session:
            model(torch.ones(4))
            session.step()
        runs.append(probe.load(tmp_path / name).ops(0))
    return runs[0], runs[1]


def _clone_pairs(matches: list[matching.Match]) -> list[tuple[str, str, str]]:
    return [(m.a.id.rsplit(":", 1)[1], m.b.id.rsplit(":", 1)[1], m.how)
            for m in matches if m.a is not None and m.b is not None and "clone" in m.a.name]


def test_an_extra_op_of_a_name_leaves_that_names_ops_aligned_in_order(tmp_path: Path) -> None:
    ops_a, ops_b = _ops(tmp_path)
    pairs = _clone_pairs(matching.match_ops(ops_a, ops_b))
    # Run A's k-th clone is run B's (k+1)-th: the same value, found by alignment, not the k-th by id.
    assert pairs == [(str(k), str(k + 1), "aligned") for k in range(10)]
    report_free = [m for m in matching.match_ops(ops_a, ops_b) if m.b is not None and m.a is None]
    assert [m.b.id for m in report_free if "clone" in m.b.name] == ["forward:[0]:aten.clone.default:0"]


def test_beyond_the_alignment_limit_the_ids_pair_them(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ops_a, ops_b = _ops(tmp_path)
    monkeypatch.setattr(matching, "ALIGN_LIMIT", 5)
    pairs = _clone_pairs(matching.match_ops(ops_a, ops_b))
    # By id, the n-th with the n-th: another value each (1.5x apart), which dataflow refuses as it
    # reaches them; none is paired with its twin.
    assert all(a == b for a, b, how in pairs if how == "id")
    assert not [p for p in pairs if int(p[1]) == int(p[0]) + 1]
