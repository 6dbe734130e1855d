"""The multi-tensor Triton kernel of the statistics engine (``probe.modes.statistics.multi_tensor``),
checked against exact fp64 statistics: under Triton's interpreter on the CPU (so that CI, which has
no GPU, checks the accelerator path's kernel), and compiled on a CUDA device where there is one.
The checks themselves are in ``tests/multi_tensor_checks.py``, run in a process of their own: the
interpreter is chosen when triton is imported."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECKS = Path(__file__).with_name("multi_tensor_checks.py")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (the test extra installs it)")


def _run_checks(device: str, interpret: bool) -> str:
    root = CHECKS.parent.parent
    # The package from this checkout, installed or not (pytest put it on sys.path, not the child).
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, str(CHECKS), device], env=env, capture_output=True, text=True,
                          timeout=900, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@needs_triton
def test_multi_tensor_rows_are_exact_under_the_triton_interpreter() -> None:
    assert "ok" in _run_checks("cpu", interpret=True)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_multi_tensor_rows_are_exact_on_cuda() -> None:
    assert "ok" in _run_checks("cuda", interpret=False)


def test_a_failing_strided_form_turns_off_only_strided_views(monkeypatch):
    # A Triton that cannot build the kernel's strided form here: strided views go back to the
    # compiled and eager kernels, with one warning; contiguous batches stay on the kernel.
    from probe.modes.statistics import reduce
    from probe.modes.statistics.columns import raw_row

    monkeypatch.setattr(reduce, "MULTI_TENSOR_DEVICES", ("cpu",))
    monkeypatch.setattr(reduce, "_multi_tensor_strided", True)
    batches = []

    def kernel(xs, threshold):
        batches.append(len(xs))
        if not all(x.is_contiguous() for x in xs):
            raise RuntimeError("strided form unavailable")
        return torch.stack([raw_row(x.double().reshape(-1), threshold) for x in xs])

    plain = torch.randn(5000)
    half = torch.randn(4, 4, 128, 64)[..., :32]
    stats = reduce.TensorStats()
    with reduce.multi_tensor_kernel_replaced(kernel), pytest.warns(UserWarning, match="strided views"):
        rows = reduce.device_row_list([plain, half], stats=stats)
    for x, row in zip([plain, half], rows, strict=True):
        want = raw_row(x.double().reshape(-1), 0.0)
        assert torch.allclose(row.double(), want, rtol=1e-7), (row, want)
    with reduce.multi_tensor_kernel_replaced(kernel):
        assert stats.uses_multi_tensor(plain) and not stats.uses_multi_tensor(half)
