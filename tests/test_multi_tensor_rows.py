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
