"""Reading damaged, hostile or long runs: a ProbeError naming the file, "not compared" for missing
data, never a traceback, a silent pass or unbounded memory."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import struct
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import probe
from probe import ProbeError, ProbeWarning
from probe.analysis.summary import ranked, summarize
from probe.cli import main
from probe.demo.train import DemoTraining, train
from probe.exporters.compare_report import csv_safe
from probe.exporters.console import LOG_WIDTH, make_console, render_step
from probe.modes.dump.file_names import CALLS_FILE, TENSOR_INDEX_FILE, TENSORS_DIR, tensors_dir
from probe.modes.free_benchmark.files import CHECKS_FILE
from probe.modes.monitor.file_names import ANOMALIES_FILE, MONITOR_FILE
from probe.modes.stats.file_names import STATS_FILE, STATS_INDEX_FILE
from probe.rundir import layout
from probe.rundir.nonfinite_origins import first_nonfinite_in
from probe.rundir.run import STEPS_KEPT

# -- runs to damage ------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A stats+dump run of the demo model (2 steps, call sites), and a free-benchmark+monitor
    run of a small MLP whose second step holds a NaN (checks, monitor series, anomalies)."""
    root = tmp_path_factory.mktemp("runs")
    training = DemoTraining()
    session = probe.mode(["stats", "dump"], out=root / "demo", model=training.model, stack=True)
    train(training, 2, session=session)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        with probe.mode(["free_benchmark", "monitor"], out=root / "checked", model=model,
                        targets={"*": {"output": "tensor"}}) as session:
            for step in range(2):
                x = torch.randn(3, 4)
                if step == 1:
                    x[0, 0] = float("nan")
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                session.step()
    return {"demo": root / "demo", "checked": root / "checked"}


def _copy(run: Path, to: Path) -> Path:
    """A copy of ``run`` sharing its files (hard links): damage replaces a file, never writes into one."""
    shutil.copytree(run, to, copy_function=os.link)
    return to


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)


# -- kinds of damage: bytes -> bytes (None: the kind does not apply to this file) ------------


def _json_lines(data: bytes) -> tuple[list[object], bool]:
    text = data.decode()
    if text.lstrip().startswith(("{", "[")) and "\n{" not in text.strip():
        return [json.loads(text)], False
    return [json.loads(line) for line in text.splitlines() if line.strip()], True


def _dump_json(values: list[object], lines: bool) -> bytes:
    if lines:
        return "".join(json.dumps(v) + "\n" for v in values).encode()
    return json.dumps(values[0]).encode()


def _missing_key(data: bytes) -> bytes | None:
    values, lines = _json_lines(data)
    if not values or not all(isinstance(v, dict) and v for v in values):
        return None
    return _dump_json([{k: x for k, x in v.items() if k != _key_to_drop(v)} for v in values], lines)  # type: ignore[arg-type]


def _key_to_drop(value: dict) -> str:
    """A key the file cannot do without where the file has one (else its first)."""
    required = ("format_version", "i", "op", "tensors", "blobs", "args")
    return next((k for k in required if k in value), next(iter(value)))


def _list_for_object(data: bytes) -> bytes | None:
    values, lines = _json_lines(data)
    return _dump_json([[] for _ in values], lines) if values else None


def _string_for_number(data: bytes) -> bytes | None:
    changed = re.sub(rb'([:\[,]\s*)(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?=\s*[,\]}])', rb'\1"\2"', data)
    return changed if changed != data else None


def _bad_keys(data: bytes) -> bytes | None:
    values, lines = _json_lines(data)
    if not values or not all(isinstance(v, dict) for v in values):
        return None
    return _dump_json([{f"{k}~": x for k, x in v.items()} for v in values], lines)  # type: ignore[union-attr]


def _csv_text_for_number(data: bytes) -> bytes | None:
    lines = data.decode().splitlines()
    if len(lines) < 2:
        return None
    cells = lines[1].split(",")
    cells[-1] = "lots"
    return "\n".join([lines[0], ",".join(cells), *lines[2:]]).encode()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _wrong_shape(data: bytes) -> bytes:
    array = np.load(io.BytesIO(data))
    return _npy(array[:, :-1] if array.ndim == 2 else array.reshape(-1))


def _index_past_the_end(data: bytes) -> bytes:
    array = np.load(io.BytesIO(data)).copy()
    array[-1] = 10**6
    return _npy(array)


def _negative_index(data: bytes) -> bytes:
    array = np.load(io.BytesIO(data)).copy()
    array[0, 0] = -1
    return _npy(array)


DAMAGE: dict[str, Callable[[bytes], bytes | None]] = {
    "truncated": lambda data: data[: len(data) // 2] if len(data) > 1 else None,
    "empty": lambda data: b"" if data else None,
    "non-utf8": lambda data: data[: len(data) // 2] + b"\xff\xfe\xfd" + data[len(data) // 2 :],
    "missing key": _missing_key,
    "list for object": _list_for_object,
    "string for number": _string_for_number,
    "bad keys": _bad_keys,
}
STATS_DAMAGE: dict[str, Callable[[bytes], bytes | None]] = {
    "truncated": lambda data: data[: len(data) // 2],
    "wrong shape": _wrong_shape,
    "not numpy": lambda data: b'{"rows": 3}',
}
INDEX_DAMAGE = {**STATS_DAMAGE, "index past the end": _index_past_the_end, "negative index": _negative_index}
CSV_DAMAGE: dict[str, Callable[[bytes], bytes | None]] = {
    "truncated": lambda data: data[: len(data) // 2] + b"\n" if len(data) > 1 else None,
    "non-utf8": lambda data: data[:40] + b"\xff\xfe" + data[40:],
    "text for number": _csv_text_for_number,
    "bad keys": lambda data: b"k~" + data if data else None,
}

# (run, file relative to the run, damage kinds, must the damage be refused by name)
METADATA = [
    ("demo", layout.RUN_FILE, DAMAGE, True),
    ("demo", f"rank0/step0/{layout.MANIFEST_FILE}", DAMAGE, True),
    ("demo", f"rank0/step0/{layout.OPS_FILE}", DAMAGE, True),
    ("demo", f"rank0/step0/{layout.CALLSITES_FILE}", DAMAGE, False),
    ("demo", f"rank0/step0/{layout.MODULES_FILE}", DAMAGE, False),
    ("demo", f"rank0/step0/{TENSOR_INDEX_FILE}", DAMAGE, True),
    ("demo", f"rank0/step0/{CALLS_FILE}", DAMAGE, False),
    ("demo", f"rank0/step0/{STATS_FILE}", STATS_DAMAGE, True),
    ("demo", f"rank0/step0/{STATS_INDEX_FILE}", INDEX_DAMAGE, True),
    ("demo", f"rank0/{layout.RANK_FILE}", DAMAGE, False),
    ("checked", f"rank0/step0/{CHECKS_FILE}", DAMAGE, False),
    ("checked", f"rank0/step1/{ANOMALIES_FILE}", DAMAGE, False),
    ("checked", f"rank0/step0/{MONITOR_FILE}", CSV_DAMAGE, False),
]
CASES = [(run, name, kind) for run, name, kinds, _ in METADATA for kind in kinds]
MUST_REFUSE = {name for _, name, _, refused in METADATA if refused}
# Damage a careful reader may accept: an extra key is a newer probe's; an empty file of rows is no rows.
BENIGN = {"bad keys", "empty"}


def _read_everything(path: Path, reference: Path, replay: bool) -> None:
    """Every reader a user reaches: load, records of each step, findings, summary, compare, replay."""
    run = probe.load(path)
    for rank in run.ranks:
        run.process(rank)
        for step in run.steps_of(rank):
            run.step_info(step, rank)
            ops = run.ops(step, rank)
            run.graph(step, rank)
            run.checks(step, rank)
            run.monitor(step, rank)
            run.anomalies_of(step, rank)
            run.module_types(step, rank)
            if run.has_dump(step, rank):
                dump = run.dump(step, rank)
                for op in ops[:40]:
                    if any(io == "output" and o == op.index for o, io, _ in dump.entries):
                        dump.call(op.index)
    run.checks()
    run.anomalies()
    run.first_nonfinite()
    list(summarize(run))
    assert probe.compare(reference, path, steps=[0]).rows
    if replay and run.has_dump():
        probe.replay_step(run)


@pytest.mark.parametrize(("run_name", "name", "kind"), CASES, ids=[f"{n}:{k}" for _, n, k in CASES])
def test_damaged_metadata_is_a_probe_error_naming_the_file(runs, tmp_path, capsys, run_name, name, kind):
    kinds = next(kinds for r, n, kinds, _ in METADATA if (r, n) == (run_name, name))
    damaged = _copy(runs[run_name], tmp_path / "damaged")
    path = damaged / name
    data = kinds[kind](path.read_bytes())
    if data is None:
        pytest.skip(f"{kind} does not apply to {name}")
    _replace(path, data)
    try:
        _read_everything(damaged, runs[run_name], replay=name.endswith(CALLS_FILE))
        refused = None
    except ProbeError as e:  # any other exception type fails the test
        refused = str(e)
    if name in MUST_REFUSE and kind not in BENIGN:
        assert refused is not None, f"{kind} {name} was read as if whole"
    if refused is not None:
        assert path.name in refused, refused
        assert "\n" not in refused
    codes = {command: main([*args, str(damaged)] if command != "compare" else
                           ["compare", "--steps", "0", str(runs[run_name]), str(damaged)])
             for command, args in (("summary", ["summary"]), ("compare", []),
                                   ("graph", ["graph", "--format", "json", "-o", str(tmp_path / "g.json")]))}
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert set(codes.values()) <= {0, 2}, codes
    if refused is not None and name == layout.RUN_FILE:
        assert codes == {"summary": 2, "compare": 2, "graph": 2}, (codes, err)
    elif refused is not None and name in (f"rank0/step0/{layout.OPS_FILE}",
                                          f"rank0/step0/{layout.MANIFEST_FILE}"):
        # The damaged step is reported and skipped (tests/test_damaged_steps.py); a graph of it is refused.
        assert codes == {"summary": 0, "compare": 0, "graph": 2}, (codes, err)
    for line in err.splitlines():
        assert line.startswith("probe: error: ") or "Warning" in line or line.startswith("  "), line


def test_a_shard_header_length_of_2_62_and_a_cut_shard_are_not_compared(runs, tmp_path):
    for damage in ("header", "cut", "deleted"):
        damaged = _copy(runs["demo"], tmp_path / damage)
        shard = next(tensors_dir(damaged, 0, 0).glob("shard-*.safetensors"))
        data = shard.read_bytes()
        if damage == "deleted":
            shard.unlink()
        else:
            cut = struct.pack("<Q", 2**62) + data[8:] if damage == "header" else data[: len(data) // 2]
            _replace(shard, cut)
        report = probe.compare(runs["demo"], damaged, steps=[0])
        uncompared = [row for row in report.rows if row["verdict"] == "not compared"]
        assert uncompared, damage
        assert all(shard.name in row["message"] for row in uncompared), uncompared[0]["message"]
        assert report.counts["not compared"] == len(uncompared) and not report.ok
        with pytest.raises(ProbeError, match=shard.name):
            probe.load(damaged).tensor(uncompared[0]["op_b"], step=0)


def test_format_checks_refuse_foreign_and_impossible_versions(runs, tmp_path):
    cases = {
        "version 0": (layout.RUN_FILE, {"format_version": 0}, "format version 0"),
        "foreign format": (layout.RUN_FILE, {"format": "other-tool"}, "not a probe run"),
        "no format": (layout.RUN_FILE, {"format": None}, "not a probe run"),
        "manifest 99": (f"rank0/step0/{layout.MANIFEST_FILE}", {"format_version": 99}, "upgrade probe"),
    }
    for label, (name, change, message) in cases.items():
        damaged = _copy(runs["demo"], tmp_path / label.replace(" ", "_"))
        path = damaged / name
        _replace(path, json.dumps({**json.loads(path.read_text()), **change}).encode())
        with pytest.raises(ProbeError, match=message):
            run = probe.load(damaged)
            run.step_info(0)
            run.ops(0)


def test_a_mode_this_reader_does_not_know_is_read_with_a_warning(runs, tmp_path):
    damaged = _copy(runs["demo"], tmp_path / "newer")
    path = damaged / f"rank0/step0/{layout.MANIFEST_FILE}"
    manifest = json.loads(path.read_text())
    manifest["modes"]["hologram_mode_v9"] = {"rows": 3}
    _replace(path, json.dumps(manifest).encode())
    run = probe.load(damaged)
    with pytest.warns(ProbeWarning, match="hologram_mode_v9"):
        assert run.step_info(0).complete
    assert len(run.ops(0)) == len(probe.load(runs["demo"]).ops(0))


def test_a_shard_name_outside_the_run_is_refused(runs, tmp_path):
    for label, shard in (("parent", "../../../../etc/passwd"), ("absolute", "/etc/passwd")):
        damaged = _copy(runs["demo"], tmp_path / label)
        path = damaged / f"rank0/step0/{TENSOR_INDEX_FILE}"
        index = json.loads(path.read_text())
        index["blobs"] = {blob: [shard, name] for blob, (_, name) in index["blobs"].items()}
        _replace(path, json.dumps(index).encode())
        run = probe.load(damaged)
        op = next(op for op in run.ops(0) if (op.index, "output", 0) in run.dump(0).entries
                  and run.dump(0).entries[(op.index, "output", 0)].blob is not None)
        with pytest.raises(ProbeError, match="not a plain file name"):
            run.tensor(op.id)
        report = probe.compare(runs["demo"], damaged, steps=[0])
        row = next(r for r in report.rows if r["op_a"] == op.id)
        assert row["verdict"] == "not compared" and "not a plain file name" in row["message"]


# -- missing data is never agreement -------------------------------------------------


def _different_dump_runs(root: Path) -> tuple[Path, Path]:
    for name, seed in (("a", 0), ("b", 1)):
        training = DemoTraining(seed=seed)
        train(training, 1, session=probe.mode("dump", out=root / name, model=training.model))
    return root / "a", root / "b"


def test_deleted_shards_are_not_compared_and_fail_the_check(tmp_path, capsys):
    a, b = _different_dump_runs(tmp_path)
    shutil.rmtree(b / "rank0" / TENSORS_DIR)
    report = probe.compare(a, b)
    verdicts = {row["verdict"] for row in report.rows}
    assert "not compared" in verdicts and report.counts["not compared"] > 100
    # Without data or statistics nothing is known of the dumped outputs: none of them passes.
    dumped = {(e.op, e.position) for e in probe.load(a).dump(0).entries.values()
              if e.io == "output" and e.status is None and e.blob is not None}
    assert not [r for r in report.rows if r["verdict"] == "pass"
                and (probe.load(a).op(r["op_a"]).index, 0) in dumped]
    out = tmp_path / "report"
    assert main(["compare", str(a), str(b), "-o", str(out), "--fail-on-divergence"]) == 1
    assert "not compared" in capsys.readouterr().out
    summary = json.loads((out / "report.json").read_text())
    assert summary["counts"]["not compared"] == report.counts["not compared"] and summary["ok"] is False
    with open(out / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    uncompared = [r for r in rows if r["Result"] == "not compared"]
    assert uncompared
    assert all("run B" in r["Err_message"] and "shard-" in r["Err_message"] for r in uncompared)
    page = (out / "report.html").read_text()
    assert "class='not-compared'" in page and "could not be compared" in page


def test_an_uncompared_producer_is_unknown_not_agreement(tmp_path):
    x = torch.randn(8, 8)
    for name, w in (("a", torch.zeros(8, 8)), ("b", torch.ones(8, 8))):
        with probe.mode("dump", out=tmp_path / name):
            doubled = x * 2  # op #0: equal in both runs, but B's copy is lost below
            _ = doubled + w  # op #1: differs through w, which comes from outside the step
    index_path = tmp_path / "b" / f"rank0/step0/{TENSOR_INDEX_FILE}"
    index = json.loads(index_path.read_text())
    for entry in index["tensors"]:
        if entry["op"] == 0 and entry["io"] == "output":
            entry["status"], entry["blob"] = "lost: shard-00000.safetensors: [Errno 28] No space left", None
    _replace(index_path, json.dumps(index).encode())
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert [row["verdict"] for row in report.rows] == ["not compared", "error"]
    assert "No space left" in report.rows[0]["message"]
    d = report.divergence
    assert d is not None and d.op_a.index == 1 and d.inputs_assumed


def test_stats_only_runs_still_compare_on_statistics(runs, tmp_path):
    for name in ("a", "b"):
        training = DemoTraining()
        train(training, 1, session=probe.mode("stats", out=tmp_path / name, model=training.model))
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.counts["not compared"] == 0 and report.ok
    assert {row["compared"] for row in report.rows} <= {"stats", "shape", None}  # None: no outputs


# -- reports, console and command line -----------------------------------------------


def test_csv_cells_cannot_become_formulas(tmp_path):
    cells = ("=1+2", "+x", "-x", "@SUM(A1)", "\t=x", "\r=x", "-0.5", "1e-3", "-inf", "ok")
    assert [csv_safe(v) for v in cells] == ["'=1+2", "'+x", "'-x", "'@SUM(A1)", "'\t=x", "'\r=x", "-0.5",
                                            "1e-3", "-inf", "ok"]
    for name in ("a", "b"):
        model = torch.nn.Sequential()
        model.add_module('=HYPERLINK("http:evil","x")', torch.nn.Linear(3, 3))
        torch.manual_seed(0)
        with probe.mode("stats", out=tmp_path / name, model=model):
            model(torch.randn(2, 3))
    probe.compare(tmp_path / "a", tmp_path / "b").to_csv(tmp_path / "report.csv")
    with open(tmp_path / "report.csv", newline="") as f:
        modules = {row["Module"] for row in csv.DictReader(f)}
    assert "'=HYPERLINK(\"http:evil\",\"x\")" in modules
    assert not any(m.startswith(("=", "+", "-", "@")) for m in modules)


def test_report_summary_and_counts_are_values(runs):
    report = probe.compare(runs["demo"], runs["demo"], steps=[0])
    assert isinstance(report.counts, dict) and isinstance(report.summary, dict)
    assert str(report.counts).startswith("{'pass': ") and report.summary["counts"] == report.counts
    assert report.ok


def test_usage_errors_exit_2_with_one_line(runs, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere" / "at-all")
    run = str(runs["demo"])
    commands = {
        "compare -o FILE": ["compare", run, run, "-o", str(a_file)],
        "compare -o dangling": ["compare", run, run, "-o", str(dangling)],
        "graph -o DIR": ["graph", run, "--format", "json", "-o", str(tmp_path)],
        "graph -o dangling": ["graph", run, "--format", "json", "-o", str(dangling)],
        "graph -o in a file": ["graph", run, "--format", "json", "-o", str(a_file / "g.json")],
        "view --out FILE": ["view", run, "--out", str(a_file), "--no-browser"],
    }
    for label, argv in commands.items():
        assert main(argv) == 2, label
        err = capsys.readouterr().err
        assert err.startswith("probe: error: ") and err.count("\n") == 1, (label, err)
    with pytest.raises(SystemExit) as exit_info:
        main(["view", run, "--port", "99999"])
    assert exit_info.value.code == 2 and "99999" in capsys.readouterr().err


def test_replay_says_why_ops_were_not_replayed(tmp_path, capsys):
    with probe.mode("dump", out=tmp_path / "r"):
        x = torch.randn(4, 4)
        (x @ x).relu().sum().item()
    results = probe.replay_step(tmp_path / "r")
    skipped = [r for r in results if "skipped" in r]
    assert {r["reason"] for r in skipped} >= {"random", "no output"}
    assert main(["replay", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "could not be replayed" in out and "random" in out and "no output" in out


def test_logs_get_wide_tables_so_op_ids_stay_on_one_line(runs):
    buffer = io.StringIO()
    console = make_console(buffer)
    assert console.width == LOG_WIDTH
    summary = next(iter(summarize(probe.load(runs["demo"]))))
    render_step(console, summary)
    text = buffer.getvalue()
    assert all(e.op.id in text for e in summary.largest_abs_max)


# -- long runs: bounded memory, the summary streams ------------------------------------


def test_a_long_run_is_read_with_a_bounded_cache_and_the_fast_summary_agrees(tmp_path):
    steps = 300
    w = torch.randn(8, 8)
    with probe.mode("stats", out=tmp_path / "long") as session:
        for step in range(steps):
            x = torch.randn(4, 8)
            if step % 97 == 5:
                x[1, 2] = float("nan")  # tanh would absorb an inf: no fault
            torch.tanh(x @ w).exp().sum()
            session.step()
    run = probe.load(tmp_path / "long")
    assert run.steps == list(range(steps))
    summaries = summarize(run)
    assert not isinstance(summaries, list)  # a generator: one step at a time
    for summary in summaries:
        ops = run.ops(summary.step, summary.rank)
        bad = first_nonfinite_in(ops)
        assert (summary.first_nonfinite.index if summary.first_nonfinite else None) == \
            (bad.index if bad else None), summary.step
        largest = max((t.abs_max for op in ops for t in op.outputs if ranked(t)), default=None)
        assert (summary.largest_abs_max[0].value if summary.largest_abs_max else None) == largest
        assert len(run._ops) <= STEPS_KEPT and len(run._files) <= STEPS_KEPT
    assert [s.step for s in summarize(run) if s.first_nonfinite is not None] == \
        [s for s in range(steps) if s % 97 == 5]
    assert main(["summary", str(tmp_path / "long")]) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
