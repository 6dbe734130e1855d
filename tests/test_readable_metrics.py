"""Errors reported at the tensor's scale (issue 36): a healthy fp32 op replayed in fp64 reads as
healthy, though element-wise ULP and relative error on its near-zero outputs read as alarms."""

from __future__ import annotations

import math

import torch

import probe
from probe.analysis.metrics import tensor_metrics
from probe.cli import main

K = 256
# Higham's probabilistic bound on a K-term fp32 dot product: |error| <~ lambda sqrt(K) u sum|a_i w_i|,
# with lambda ~ 1. For standard normal a, w: sum|a_i w_i| ~ K (2/pi), the output's rms ~ sqrt(K), and
# the spacing at the rms is more than rms u. So the error in ULPs at the rms's scale stays under
# K (2/pi), while an element that cancels to ~0 reads as any number of its own ULPs.
HEALTHY_ULP_AT_SCALE = K * 2 / math.pi


def test_a_healthy_fp32_matmul_against_fp64_reads_as_a_few_ulp_at_scale():
    torch.manual_seed(0)
    a, w = torch.randn(64, K), torch.randn(K, 512)
    m = tensor_metrics(a.double() @ w.double(), a @ w)
    assert m.max_ulp > 10 * HEALTHY_ULP_AT_SCALE  # the element-wise alarm (2.6e4 here)
    assert m.max_rel_err > 1e-3
    assert m.max_ulp_at_scale < HEALTHY_ULP_AT_SCALE  # 11.5 here
    assert m.max_abs_err / m.ref_rms < HEALTHY_ULP_AT_SCALE * 2.0**-23
    # Elements at or above the rms keep their own ULPs: a real fault there reads in full.
    faulty = (a @ w).clone()
    faulty[0, 0] = faulty.abs().max() * (1 + 2.0**-10)
    assert tensor_metrics(a.double() @ w.double(), faulty).max_ulp_at_scale > 1000


def test_replay_ranks_and_shows_errors_at_scale(tmp_path, capsys):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(K, 512, bias=False)
    with probe.mode("dump", out=tmp_path / "r", model=lm_head):
        lm_head(torch.randn(64, K))
    ranked = [r for r in probe.replay_step(tmp_path / "r", dtype=torch.float64) if "skipped" not in r]
    mm = next(r for r in ranked if r["name"].startswith("aten.mm"))
    assert mm["max_ulp"] > 10 * HEALTHY_ULP_AT_SCALE
    assert mm["max_ulp_at_scale"] < HEALTHY_ULP_AT_SCALE and mm["scaled_err"] < 1e-5
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "r"), "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "ULP at scale" in out and "max err / rms" in out and "max rel err" not in out
