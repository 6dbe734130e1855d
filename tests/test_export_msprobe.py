"""probe export msprobe: msprobe's layout, read by the real msprobe compare when it is installed."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import probe
from probe.cli import main
from tests.conftest import SharedBlockNet, train_steps

REPO = Path(__file__).resolve().parents[1]


def _msprobe() -> str | None:
    for candidate in (os.environ.get("PROBE_MSPROBE"), str(REPO / ".venv-msprobe/bin/msprobe"),
                      shutil.which("msprobe")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _record(out: Path, modes, perturb: float = 0.0) -> None:
    torch.manual_seed(0)
    model = SharedBlockNet()
    with torch.no_grad():
        model.head.weight[0, 0] += perturb
    with probe.mode(modes, out=out, model=model, stack=True) as session:
        train_steps(model, 1, session=session, optimizer="sgd")


def test_export_writes_msprobe_layout_with_tensors_and_statistics(tmp_path):
    _record(tmp_path / "run", ["stats", "dump"])
    assert main(["export", "msprobe", str(tmp_path / "run"), str(tmp_path / "ms")]) == 0
    rank_dir = tmp_path / "ms" / "step0" / "rank0"
    dump = json.loads((rank_dir / "dump.json").read_text())
    assert dump["task"] == "tensor" and dump["framework"] == "pytorch"
    run = probe.load(tmp_path / "run")
    ops = run.ops(0)
    assert len(dump["data"]) == len(ops)
    first_addmm = next(op for op in ops if op.name == "aten.addmm.default")
    entry = dump["data"]["Aten.addmm.default.0.forward"]
    out = entry["output"][0]
    assert out["dtype"] == "torch.float32" and out["shape"] == list(first_addmm.outputs[0].shape)
    assert out["Max"] == pytest.approx(first_addmm.outputs[0].stats["max"])
    saved = torch.load(rank_dir / "dump_tensor_data" / out["data_name"], weights_only=True)
    assert torch.equal(saved, run.tensor(first_addmm.id, "output", 0))
    backward = [name for name in dump["data"] if name.endswith(".backward")]
    assert "Aten.gelu_backward.default.0.backward" in backward
    construct = json.loads((rank_dir / "construct.json").read_text())
    assert construct["Aten.addmm.default.0.forward"] == "Module.inp.Linear.forward.0"
    stack = json.loads((rank_dir / "stack.json").read_text())
    assert stack and all(line.startswith("File ") for _, lines in stack.values() for line in lines)


def test_export_refuses_a_run_without_values(tmp_path):
    _record(tmp_path / "run", "structure")
    assert main(["export", "msprobe", str(tmp_path / "run"), str(tmp_path / "ms")]) == 2


def _compare(msprobe: str, target: Path, golden: Path, out: Path) -> list[dict[str, str]]:
    result = subprocess.run(
        [msprobe, "compare", "-tp", str(target / "step0"), "-gp", str(golden / "step0"), "-o", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (report,) = out.glob("compare_result_*.csv")
    with open(report, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(_msprobe() is None, reason="mindstudio-probe's msprobe CLI is not installed "
                    "(make test installs it in .venv-msprobe; or set PROBE_MSPROBE)")
def test_msprobe_compare_reads_two_exported_tensor_runs(tmp_path):
    msprobe = _msprobe()
    _record(tmp_path / "golden", ["stats", "dump"])
    _record(tmp_path / "target", ["stats", "dump"], perturb=1e-2)
    for name in ("golden", "target"):
        assert main(["export", "msprobe", str(tmp_path / name), str(tmp_path / f"{name}-ms")]) == 0
    rows = _compare(msprobe, tmp_path / "target-ms", tmp_path / "golden-ms", tmp_path / "cmp")
    by_name = {row["NPU Name"]: row for row in rows}
    # Untouched by the perturbation: the first layer's forward matmul is identical.
    first = by_name["Aten.addmm.default.0.forward.output.0"]
    assert float(first["Cosine"]) == pytest.approx(1.0) and float(first["MaxAbsErr"]) == 0.0
    # The perturbed head's output differs.
    head = by_name["Aten.addmm.default.3.forward.output.0"]
    assert float(head["MaxAbsErr"]) > 0
    assert all(row["Bench Name"] != "N/A" for row in rows)


@pytest.mark.skipif(_msprobe() is None, reason="mindstudio-probe's msprobe CLI is not installed "
                    "(make test installs it in .venv-msprobe; or set PROBE_MSPROBE)")
def test_msprobe_compare_reads_two_exported_statistics_runs(tmp_path):
    msprobe = _msprobe()
    for name in ("golden", "target"):
        _record(tmp_path / name, "stats")
        assert main(["export", "msprobe", str(tmp_path / name), str(tmp_path / f"{name}-ms")]) == 0
    rows = _compare(msprobe, tmp_path / "target-ms", tmp_path / "golden-ms", tmp_path / "cmp")
    assert rows and {row["Result"] for row in rows} == {"pass"}
    assert all(row["Bench Name"] != "N/A" for row in rows)


def test_op_names_with_path_characters_become_one_file_each(tmp_path):
    """A run's op names are not trusted: '/' (before: a traceback), '..', NUL and a name longer than a
    file name may be still give one tensor file each inside dump_tensor_data, named in dump.json."""
    with probe.mode(["stats", "dump"], out=tmp_path / "run"):
        x = torch.randn(3, 4)
        ((x.exp() * 2).tanh() + 1).sum()
    ops_file = tmp_path / "run" / "rank0" / "step0" / "ops.jsonl"
    names = {"aten.exp.default": "aten.e/xp.default", "aten.mul.Tensor": "../../../escape",
             "aten.tanh.default": "aten.t\u0000anh." + "x/" * 200, "aten.add.Tensor": "aten.e%2Fxp.default"}
    text = ops_file.read_text()
    for old, new in names.items():
        assert json.dumps(old) in text
        text = text.replace(json.dumps(old), json.dumps(new))
    ops_file.unlink()
    ops_file.write_text(text)

    assert main(["export", "msprobe", str(tmp_path / "run"), str(tmp_path / "ms")]) == 0
    data_dir = tmp_path / "ms" / "step0" / "rank0" / "dump_tensor_data"
    written = sorted(p for p in (tmp_path / "ms").rglob("*") if p.is_file() and p.suffix == ".pt")
    assert all(p.parent == data_dir for p in written), written
    dump = json.loads((data_dir.parent / "dump.json").read_text())
    run = probe.load(tmp_path / "run")
    by_name = {op.name: op for op in run.ops(0)}
    data_names = set()
    for new in names.values():
        (entry,) = [e for e in dump["data"] if e.startswith(f"Aten.{new.removeprefix('aten.')}.0.")]
        out = dump["data"][entry]["output"][0]
        data_names.add(out["data_name"])
        saved = torch.load(data_dir / out["data_name"], weights_only=True)
        assert torch.equal(saved, run.tensor(by_name[new].id, "output", 0))
    assert len(data_names) == len(names)  # '/' and its percent-encoding stay apart
