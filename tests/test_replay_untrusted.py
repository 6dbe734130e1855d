"""Replay of an untrusted run is confined: a run edited by hand cannot make ``probe replay`` read
a file, load a library, walk attributes of ``torch.ops`` or allocate without bound.

Each case dumps a small real run, edits its files as a hostile tester did (an op renamed, its
recorded call or record changed), and replays it: the op is refused (one line naming the op and
why; in a step replay a skipped row with reason "refused") before anything is executed or
allocated, and the other ops of the step are still replayed.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

import probe
from probe import ProbeError
from probe.analysis.replay_confinement import refusal
from probe.cli import main
from probe.rundir import streamed_json
from probe.rundir.call_args import decode_args
from probe.vocabulary.op_class import resolve_op

TERABYTES = [1 << 20, 1 << 20]
"""Repeats that ask 48 TB of a [4, 3] float32 tensor: refused at once by any allocator too, so
the old code's attempt to allocate them fails fast instead of filling the machine."""


@pytest.fixture(scope="module")
def intact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dumped run: randn (#0), exp (#1), repeat (#2), mm (#3)."""
    root = tmp_path_factory.mktemp("replay_untrusted")
    torch.manual_seed(0)
    with probe.mode("dump", out=root / "run"):
        x = torch.randn(4, 3)
        y = x.exp()
        y.repeat(2, 1)
        x @ y.t()
    return root / "run"


@pytest.fixture
def run(intact: Path, tmp_path: Path) -> Path:
    shutil.copytree(intact, tmp_path / "run")
    return tmp_path / "run"


def _step(run: Path) -> Path:
    return run / "rank0" / "step0"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _edit(run: Path, index: int, name: str | None = None, args: list[Any] | None = None,
          kwargs: dict[str, Any] | None = None, outputs: list[Any] | None = None) -> str:
    """Edit op #``index``: its name, its recorded call, its recorded outputs; returns its id."""
    ops, calls = _rows(_step(run) / "ops.jsonl"), _rows(_step(run) / "calls.jsonl")
    if name is not None:
        ops[index]["name"] = name
    if outputs is not None:
        ops[index]["out"] = outputs
    call = next(c for c in calls if c["i"] == index)
    call["args"] = call["args"] if args is None else args
    call["kwargs"] = call["kwargs"] if kwargs is None else kwargs
    _write_rows(_step(run) / "ops.jsonl", ops)
    _write_rows(_step(run) / "calls.jsonl", calls)
    return ops[index]["id"]


def _row(results: list[dict[str, Any]], op_id: str) -> dict[str, Any]:
    return next(r for r in results if r["op_id"] == op_id)


def _replayed(results: list[dict[str, Any]]) -> set[str]:
    return {r["name"] for r in results if "skipped" not in r}


def test_an_op_renamed_from_file_does_not_read_the_file_it_names(run, tmp_path, capsys):
    # The file holds exactly exp's dumped output: the old replay read it and reported a perfect match.
    secret = tmp_path / "outside.bin"
    secret.write_bytes(probe.load(run).tensor(probe.load(run).ops(0)[1].id).contiguous().numpy().tobytes())
    tensors = json.loads((_step(run) / "tensors.json").read_text())
    for e in tensors["tensors"]:
        if e["op"] == 1 and e["io"] == "output":
            e["shape"], e["stride"] = [12], [1]
    (_step(run) / "tensors.json").write_text(json.dumps(tensors))
    op_id = _edit(run, 1, name="aten.from_file.default", args=[str(secret), False, 12],
                  kwargs={"dtype": {"dtype": "float32"}}, outputs=[["float32", [12], False]])

    row = _row(probe.replay_step(run), op_id)
    assert row["reason"] == "refused" and "'filename'" in row["skipped"], row
    with pytest.raises(ProbeError, match=r"from_file\.default\) refused: it makes a tensor from a name"):
        probe.replay(run, op_id)
    capsys.readouterr()
    assert main(["replay", str(run), op_id]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("name", [
    "load_library.__call__.__call__",  # a method of torch.ops: an AttributeError traceback before
    "aten.mm.overloads",  # a method of an op packet
])
def test_an_op_name_that_walks_attributes_of_torch_ops_is_an_unknown_op(run, capsys, name):
    op_id = _edit(run, 3, name=name)
    results = probe.replay_step(run)
    assert _row(results, op_id)["reason"] == "unknown op"
    assert "aten.exp.default" in _replayed(results)  # the rest of the step is replayed
    with pytest.raises(ProbeError, match=r"namespace\.op\.overload|not registered"):
        resolve_op(name)
    capsys.readouterr()
    assert main(["replay", str(run)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_recorded_sizes_that_disagree_with_the_op_record_are_refused_before_allocating(run):
    op_id = _edit(run, 2, args=[{"tensor": 0}, TERABYTES])  # the record still says [8, 3]
    results = probe.replay_step(run)
    row = _row(results, op_id)
    assert row["reason"] == "refused", row  # before: "failed", after trying to allocate 48 TB
    assert "would make output 0 of shape [4194304, 3145728], its op record says [8, 3]" in row["skipped"]
    assert {"aten.exp.default", "aten.mm.default"} <= _replayed(results)


def test_recorded_sizes_with_a_record_edited_to_match_are_refused_by_the_memory_budget(run, capsys):
    huge = [4 << 20, 3 << 20]
    tensors = json.loads((_step(run) / "tensors.json").read_text())
    for e in tensors["tensors"]:  # stride 0: the dumped output fits its blob whatever its shape
        if e["op"] == 2 and e["io"] == "output":
            e["shape"], e["stride"] = huge, [0, 0]
    (_step(run) / "tensors.json").write_text(json.dumps(tensors))
    op_id = _edit(run, 2, args=[{"tensor": 0}, TERABYTES], outputs=[["float32", huge, False]])
    row = _row(probe.replay_step(run), op_id)
    assert row["reason"] == "refused" and "more than the memory budget" in row["skipped"], row
    capsys.readouterr()
    assert main(["replay", str(run)]) == 0  # refused ops are skipped ops: the exit code stays
    assert "refused" in capsys.readouterr().out
    assert main(["replay", str(run), op_id]) == 2
    err = capsys.readouterr().err
    assert "memory budget" in err and len(err.strip().splitlines()) == 1


def test_the_memory_budget_is_the_users_and_is_checked_before_the_op_runs(intact, capsys):
    mm = next(op for op in probe.load(intact).ops(0) if op.name == "aten.mm.default")
    assert probe.replay(intact, mm.id)["max_abs_err"] == 0.0
    # mm's inputs (2 x 48 bytes), its output (64 bytes) and comparing it (16 x 20 bytes): 480 bytes.
    with pytest.raises(ProbeError, match=r"refused: replaying it would take about 480 bytes \(inputs 96 "
                                         r"bytes, results 64 bytes, comparison 320 bytes\), more than the "
                                         r"memory budget of 400 bytes"):
        probe.replay(intact, mm.id, memory_budget=400)
    assert probe.replay(intact, mm.id, memory_budget=480)["max_abs_err"] == 0.0
    results = probe.replay_step(intact, memory_budget=100)
    assert {r["reason"] for r in results} == {"refused", "random"}
    with pytest.raises(ProbeError, match="memory_budget must be a positive number of bytes"):
        probe.replay_step(intact, memory_budget=0)
    capsys.readouterr()
    assert main(["replay", str(intact), "--memory-budget", "100"]) == 0
    assert "refused" in capsys.readouterr().out
    assert main(["replay", str(intact), "--memory-budget", "2KiB"]) == 0
    assert main(["replay", str(intact), mm.id, "--memory-budget", "400"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(intact), "--memory-budget", "lots"])
    assert exit_info.value.code == 2
    assert "'lots' is not a positive size in bytes" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "why"), [
    ("aten.from_file.default", "makes a tensor from a name"),
    ("aten.set_.source_Storage", "storage"),
    ("aten.set_.source_Tensor", "storage"),
    ("aten.resize_.default", "storage"),
    ("aten.resize.default", "storage"),
    ("aten.as_strided_.default", "storage"),
    ("aten.record_stream.default", "metadata"),
    ("quantized.linear_dynamic_fp16.default", "is a __torch__.torch.classes.quantized.LinearPacked"),
    ("aten._print.default", "returns no tensor"),
    ("aten._assert_async.msg", "returns no tensor"),
    ("c10d.allreduce_.default", "collective"),
    ("profiler._record_function_enter_new.default", "profiling"),
])
def test_ops_that_are_not_pure_tensor_computations_are_refused_from_their_schema(name, why):
    assert why in (refusal(resolve_op(name)) or "allowed")


@pytest.mark.parametrize("name", [
    "aten.mm.default", "aten.gelu.default", "aten.div.Tensor_mode", "aten.einsum.default",
    "aten.native_layer_norm.default", "aten._fused_adam_.default", "aten._foreach_add_.List",
    "aten.copy_.default", "aten.index_put_.default", "aten.new_empty.default", "aten.full.default",
    "aten.__lshift__.Scalar",  # a dunder name, a real op
])
def test_pure_tensor_computations_are_allowed(name):
    assert refusal(resolve_op(name)) is None


@pytest.mark.parametrize(("value", "why"), [
    ({"dtype": "load"}, "not a value a replay can rebuild"),  # before: torch.load itself
    ({"dtype": ["float32"]}, "not a value a replay can rebuild"),
    ({"tensor": -1}, "not an input position"),  # before: the last input, silently
    ({"tensor": 5}, "names an input the op does not have"),
    ({"memory_format": "sideways"}, "not a value a replay can rebuild"),  # before: KeyError
    ({"dtype": "float32", "device": "cpu"}, "not one tagged value"),  # before: ValueError
    ({"float": 1.5}, "not a value a replay can rebuild"),
])
def test_a_recorded_argument_that_no_probe_writes_is_refused_by_name(value, why):
    with pytest.raises(ProbeError, match=why):
        decode_args({"args": [value], "kwargs": {}}, [torch.zeros(1)].__getitem__)


# -- a dump index of many small entries -------------------------------------------------

INFLATED = 20_000
"""Entries added to the dump index: ~2.8 MB of JSON, which json.loads held as ~6x that in objects."""


def _inflate(run: Path, count: int) -> tuple[int, list[dict[str, Any]]]:
    """Add ``count`` entries (copies of a real one, for ops the step does not have) and a second
    entry for an existing key to ``run``'s dump index; its size and its entries, in file order."""
    path = _step(run) / "tensors.json"
    index = json.loads(path.read_text())
    entries = index["tensors"]
    template = next(e for e in entries if e["status"] is None and e["blob"] is not None)
    first = max(e["op"] for e in entries) + 1
    entries += [dict(template, op=first + i // 4, position=i % 4, offset=4 * i) for i in range(count)]
    entries.append(dict(entries[0], status="skipped: é, written unescaped"))  # the same key again: it wins
    path.write_text(json.dumps(index, separators=(",", ":"), ensure_ascii=False))
    return path.stat().st_size, entries


def test_a_dump_index_of_many_small_entries_is_read_whole_within_twice_its_size(run):
    size, written = _inflate(run, INFLATED)
    loaded = probe.load(run)
    tracemalloc.start()
    try:
        entries = loaded.dump(0, 0).entries
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Before: ~6x the file (a dict and two lists per entry, beside the text); now ~1x.
    assert peak < 2 * size, f"reading a {size}-byte index peaked at {peak} bytes"
    expected = {(e["op"], e["io"], e["position"]): e for e in written}  # a later entry wins
    assert len(entries) == len(expected) == len(written) - 1 and set(entries) == set(expected)
    for key, e in expected.items():
        entry = entries[key]
        assert (entry.dtype, entry.shape, entry.stride, entry.blob, entry.offset, entry.checksum,
                entry.status) == (e["dtype"], tuple(e["shape"]), tuple(e["stride"]), e["blob"], e["offset"],
                                  e["checksum"], e["status"]), key
    assert entries.get((0, "output", 7)) is None and entries.get((10**30, "input", 0)) is None


def test_a_dump_index_read_in_small_chunks_reads_the_same(run, monkeypatch):
    _, written = _inflate(run, 2_000)
    whole = dict(probe.load(run).dump(0, 0).entries)
    monkeypatch.setattr(streamed_json, "CHUNK", 61)  # every number and string split somewhere
    assert dict(probe.load(run).dump(0, 0).entries) == whole and len(whole) == len(written) - 1


def test_a_dump_index_that_names_a_member_twice_is_refused_by_name(run):
    # Before, the second "tensors" silently replaced the first (json.loads keeps the last key).
    path = _step(run) / "tensors.json"
    path.write_text(json.dumps(json.loads(path.read_text()), separators=(",", ":"))[:-1] + ',"tensors":[]}')
    with pytest.raises(ProbeError, match=r"cannot read '.*tensors\.json': the key 'tensors' appears twice"):
        probe.load(run).dump(0, 0)
