"""A run directory is untrusted input: every file of a real run replaced by each hostile kind.

A run of two steps (stats + dump) is copied, one file of the copy made hostile (a link to a
file outside the run, a FIFO, a device, a socket, cut short, random bytes, JSON nested
100,000 deep, a huge string field), and the run read as a user would: ``probe summary``,
``probe compare`` against the intact run, ``probe.load`` and every record and tensor. Each
case must end in a ``ProbeError`` (exit 2) or a reported skip, never a traceback; within a
time limit (a FIFO must not block the reader, ``/dev/zero`` must not be read without end);
and without opening or listing anything outside the run (an audit hook watches every open).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import probe
from probe import ProbeError, ProbeWarning
from probe.cli import main

CASE_SECONDS = 20
"""The most one case (summary, compare and reading everything) may take: a hang fails here."""
HUGE_FIELD = 4 << 20
"""The length of the huge string put into a JSON field (past an op record's 1 MiB limit)."""


# -- the run -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run: a small MLP trained two steps under stats + dump, with call sites."""
    root = tmp_path_factory.mktemp("hostile")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)  # few ops: the fuzz reads this run a few hundred times
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with probe.mode(["stats", "dump"], out=root / "run", model=model, stack=True) as session:
        for _ in range(2):
            model(torch.randn(3, 4)).tanh().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step()
    return root / "run"


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny tensors on one thread: the cases run fast on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def test_the_run_holds_every_kind_of_file(run):
    assert main(["compare", str(run), str(run)]) == 0  # and the comparison's kernels are compiled
    names = {Path(f).name for f in _files(run)}
    for name in ("run.json", "rank.json", "manifest.json", "ops.jsonl", "stats.npy", "stats_index.npy",
                 "tensors.json", "calls.jsonl", "callsites.json"):
        assert name in names
    assert any(n.endswith(".safetensors") for n in names)


# -- hostile kinds: each turns ``path`` (a file of a copy of the run) hostile ---------------


def _symlink_outside(path: Path, outside: Path) -> None:
    """The file's own bytes moved outside the run and linked to: followed, everything would pass."""
    target = outside / f"{path.parent.name}-{path.name}"
    shutil.copyfile(path, target)
    path.unlink()
    path.symlink_to(target)


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path, outside: Path) -> None:
    """A character device in the run (``/dev/zero`` itself where mknod is allowed, else a link)."""
    path.unlink()
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except (PermissionError, OSError):
        path.symlink_to("/dev/zero")


def _socket(path: Path, outside: Path) -> None:
    path.unlink()
    server = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(path.parent)  # bound by its relative name: a temporary directory's path is too long for AF_UNIX
    try:
        server.bind(path.name)
    finally:
        os.chdir(here)
    _SOCKETS.append(server)


_SOCKETS: list[socket.socket] = []


def _truncated(path: Path, outside: Path) -> None:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path: Path, outside: Path) -> None:
    size = path.stat().st_size
    path.unlink()
    path.write_bytes(random.Random(size).randbytes(max(size, 64)))


def _deep_json(path: Path, outside: Path) -> None:
    path.unlink()
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n")


def _huge_field(path: Path, outside: Path) -> None:
    """A 4 MiB string in one field of the file's first JSON object (or the whole file for a
    binary file: then a huge unterminated string)."""
    data = path.read_bytes()
    path.unlink()
    huge = "x" * HUGE_FIELD
    try:
        text = data.decode()
        lines = text.split("\n")
        first = json.loads(lines[0]) if "\n" in text.strip() else json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        path.write_bytes(b'{"' + huge.encode())
        return
    if isinstance(first, dict):
        key = next((k for k, v in first.items() if isinstance(v, str)), next(iter(first), "x"))
        first[key] = huge
    else:
        first = [huge]
    if "\n" in text.strip():
        lines[0] = json.dumps(first)
        path.write_text("\n".join(lines))
    else:
        path.write_text(json.dumps(first))


KINDS: dict[str, Callable[[Path, Path], None]] = {
    "symlink outside": _symlink_outside,
    "fifo": _fifo,
    "/dev/zero": _dev_zero,
    "socket": _socket,
    "truncated": _truncated,
    "random bytes": _random_bytes,
    "deeply nested json": _deep_json,
    "huge string field": _huge_field,
}


# -- watching the reader -------------------------------------------------------------

_watch: dict[str, Any] = {"outside": None, "opened": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # Audit hooks cannot be removed: this one only records while a case runs.
    outside = _watch["outside"]
    if outside is None or event not in ("open", "os.listdir", "os.scandir"):
        return
    target = args[0] if args else None
    if isinstance(target, (str, bytes, os.PathLike)):
        real = os.path.realpath(os.fsdecode(target))
        if real.startswith((outside, "/dev/zero", "/dev/urandom")):
            _watch["opened"].append(f"{event} {real}")


sys.addaudithook(_audit)


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise _Hang(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _read_everything(path: Path) -> int:
    """What probe.load offers, all of it: every step's records, graph, tensors, checksums; how
    many tensors were refused (one tensor's damage is its own error, the rest stay readable)."""
    refused = 0
    run = probe.load(path)
    for rank in run.ranks:
        for step in run.steps_of(rank):
            run.step_info(step, rank)
            ops = run.ops(step, rank)
            run.graph(step, rank)
            run.module_types(step, rank)
            if run.has_dump(step, rank):
                dump = run.dump(step, rank)
                dump.call(ops[0].index)
                for op_index, io, position in list(dump.entries)[:40]:
                    try:
                        run.tensor(ops[op_index].id, io, position, step, rank)
                    except ProbeError:
                        refused += 1
            checksums = run.mode_files("checksums", step, rank)
            if checksums is not None:
                checksums.checksums()  # type: ignore[attr-defined]
        run.process(rank)
        run.write_failures(rank)
    run.first_nonfinite()
    run.anomalies()
    return refused


def _case(run: Path, hostile: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Summary, compare and the API on ``hostile``: what each ended in (exit codes, errors)."""
    outcomes = []
    with _time_limit(CASE_SECONDS), warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        outcomes.append(f"summary exit {main(['summary', str(hostile)])}")
        outcomes.append(f"compare exit {main(['compare', str(run), str(hostile)])}")
        try:
            refused = _read_everything(hostile)
            outcomes.append(f"load: {refused} tensors refused" if refused else "load ok")
        except ProbeError as e:
            outcomes.append(f"load: {e}")
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return outcomes


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_file_made_hostile_is_refused_or_skipped_without_traceback_hang_or_outside_read(
        run, tmp_path, capsys, one_thread, kind):
    outside = tmp_path / "outside"
    outside.mkdir()
    failures = []
    for number, name in enumerate(_files(run)):
        hostile = tmp_path / f"case{number}"
        shutil.copytree(run, hostile, copy_function=os.link)
        try:
            KINDS[kind](hostile / name, outside)
        except OSError as e:  # e.g. a socket path too long for AF_UNIX
            pytest.skip(f"{kind} cannot be made here: {e}")
        _watch["outside"], _watch["opened"] = str(outside.resolve()), []
        try:
            outcomes = _case(run, hostile, capsys)
        except _Hang as e:
            failures.append(f"{name}: hang ({e})")
            continue
        except Exception as e:  # anything but a ProbeError reached the user
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        finally:
            _watch["outside"] = None
        if _watch["opened"]:
            failures.append(f"{name}: read outside the run: {_watch['opened'][:3]}")
        if kind in ("symlink outside", "fifo", "/dev/zero", "socket") \
                and name != "rank0/.lock" and outcomes[-1] == "load ok":
            # Every file but the writer's lock is read by the API: refusing it must show there.
            failures.append(f"{name}: accepted silently ({outcomes})")
        shutil.rmtree(hostile, ignore_errors=True)
    for server in _SOCKETS:
        server.close()
    _SOCKETS.clear()
    assert not failures, "\n".join(failures)


def _disagree(entry: dict[str, Any], how: str) -> None:
    if how == "shape":  # the same elements, another shape: it would read as a plausible tensor
        entry["shape"] = entry["shape"][::-1]
        entry["stride"] = [entry["shape"][1], 1]
    else:
        entry["dtype"] = "int32"  # the same bytes read as another type


@pytest.mark.parametrize("how", ["shape", "dtype"])
def test_a_dump_index_that_disagrees_with_its_op_record_is_refused_and_not_compared(run, tmp_path, how):
    hostile = tmp_path / "hostile"
    shutil.copytree(run, hostile, copy_function=os.link)
    path = hostile / "rank0" / "step1" / "tensors.json"
    index = json.loads(path.read_bytes())
    entry = next(e for e in index["tensors"] if e["io"] == "output" and e["status"] is None
                 and len(e["shape"]) == 2 and e["shape"][0] != e["shape"][1])
    recorded = probe.load(run).ops(1)[entry["op"]]
    _disagree(entry, how)
    path.unlink()
    path.write_text(json.dumps(index))

    with pytest.raises(ProbeError, match="disagrees with the op record") as refused:
        probe.load(hostile).tensor(recorded.id, "output", entry["position"], step=1)
    assert "tensors.json" in str(refused.value) and recorded.id in str(refused.value)

    report = probe.compare(run, hostile)
    (row,) = [r for r in report.rows if r["step"] == 1 and r["op_b"] == recorded.id]
    assert row["verdict"] == "not compared"
    assert "disagrees with the op record" in row["message"]
    others = [r for r in report.rows if r["op_b"] != recorded.id and r["verdict"] == "not compared"]
    assert not others  # the rest of the step is compared on its data
