"""NPU readiness without an NPU: torch_npu is never imported by the probe, ops of the
``npu`` namespace are recorded by name, and saturation-mode overflow (+-max instead of
inf) is counted as Inf when asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import probe


def test_importing_and_running_the_probe_never_imports_torch_npu(tmp_path):
    code = (
        "import sys, torch, probe\n"
        f"with probe.mode('stats', out={str(tmp_path / 'r')!r}) as s:\n"
        "    torch.ones(2).exp(); s.step()\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def npu_namespace_op():
    """A fused op registered in torch_npu's ``npu`` namespace (FRAGMENT: torch_npu may own it)."""
    library = torch.library.Library("npu", "FRAGMENT")
    library.define("probe_test_fused_scale(Tensor x, float alpha) -> Tensor")
    library.impl("probe_test_fused_scale", lambda x, alpha: x * alpha, "CompositeExplicitAutograd")
    yield torch.ops.npu.probe_test_fused_scale.default
    library._destroy()


def test_npu_namespace_ops_are_recorded_by_name_with_statistics(npu_namespace_op, tmp_path):
    with probe.mode("stats", out=tmp_path / "r") as session:
        npu_namespace_op(torch.full((4,), 2.0), 1.5)
        session.step()
    fused = [op for op in probe.load(tmp_path / "r").ops() if op.name.startswith("npu.")]
    assert [op.name for op in fused] == ["npu.probe_test_fused_scale.default"]
    assert fused[0].outputs[0].stats["max"] == 3.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("saturation", "expected_inf"), [(True, 2), (False, 0), ("auto", 0)])
def test_saturated_values_count_as_inf_when_the_device_saturates(tmp_path, dtype, saturation, expected_inf):
    top = torch.finfo(dtype).max
    with probe.mode("stats", out=tmp_path / "r", saturation=saturation) as session:
        x = torch.tensor([1.0, top, -top, 0.5], dtype=dtype)
        (x * 1).sum()
        session.step()
    ops = probe.load(tmp_path / "r").ops()
    mul = next(op for op in ops if op.name == "aten.mul.Tensor")
    assert mul.outputs[0].stats["inf"] == expected_inf  # "auto" on CPU: inf is inf there
    assert mul.outputs[0].stats["max"] == float(top)
    assert mul.outputs[0].stats["nan"] == 0


def test_a_bad_saturation_option_is_named(tmp_path):
    with pytest.raises(probe.ProbeError, match="'saturation'"):
        probe.mode("stats", out=tmp_path / "r", saturation="sometimes")
