"""Replaying dumped ops: bit-exact on the same device and dtype; a faulty kernel ranks first."""

from __future__ import annotations

import pytest
import torch

import probe
from probe import ProbeError
from probe.cli import main
from tests.conftest import SharedBlockNet, train_steps


@torch.library.custom_op("probetest::sloppy_gelu", mutates_args=())
def sloppy_gelu(x: torch.Tensor) -> torch.Tensor:
    """A kernel with a bug in its fp32 path only (as a device kernel might have)."""
    y = torch.nn.functional.gelu(x)
    return y * (1 + 1e-3) if x.dtype == torch.float32 else y


@sloppy_gelu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_every_replayable_op_reproduces_its_output_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet(checkpointed=True)
    with probe.mode("dump", out=tmp_path / "r", model=model) as session:
        train_steps(model, 1, session=session)
    results = probe.replay_step(tmp_path / "r")
    replayed = [r for r in results if "skipped" not in r]
    skipped = [r for r in results if "skipped" in r]
    assert len(replayed) > 100
    assert all(r["max_abs_err"] == 0.0 and r["max_ulp"] == 0.0 for r in replayed), replayed[0]
    # Every op not replayed says why; none failed: dropout's bernoulli_ is random, .item() has no output.
    reasons = {r["reason"] for r in skipped}
    assert "random" in reasons and reasons <= {"random", "no output", "not dumped"}, reasons
    assert all(r["skipped"] for r in skipped)
    one = probe.replay(tmp_path / "r", replayed[0]["op_id"])
    assert one["max_abs_err"] == 0.0 and one["cosine"] == pytest.approx(1.0)


def test_a_faulty_kernel_ranks_first_in_a_higher_precision_batch_replay(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(32, 32)
    with probe.mode("dump", out=tmp_path / "r"):
        x = torch.randn(16, 32)
        h = torch.tanh(x @ w)
        h = torch.ops.probetest.sloppy_gelu(h)
        (h.softmax(-1) * 3).sum()
    ranked = probe.replay_step(tmp_path / "r", dtype=torch.float64)
    assert ranked[0]["name"] == "probetest.sloppy_gelu.default"
    assert ranked[0]["max_ulp"] > 10 * max(r["max_ulp"] for r in ranked[1:] if "skipped" not in r)
    assert main(["replay", str(tmp_path / "r"), "--dtype", "float64", "--top", "3"]) == 0
    assert main(["replay", str(tmp_path / "r"), ranked[0]["op_id"], "--dtype", "fp64"]) == 0


def test_replay_errors_name_the_problem(tmp_path):
    with probe.mode("stats", out=tmp_path / "s"):
        torch.ones(3).exp()
    op_id = probe.load(tmp_path / "s").ops(0)[1].id
    with pytest.raises(ProbeError, match="has no dump"):
        probe.replay(tmp_path / "s", op_id)
    with pytest.raises(ProbeError, match="no op 'nope'"):
        probe.replay(tmp_path / "s", "nope")
    assert main(["replay", str(tmp_path / "s"), op_id, "--dtype", "float128"]) == 2


@pytest.mark.parametrize("device", ["bogus", "cuda", "cuda:9", "meta"])
def test_a_device_this_process_cannot_compute_on_is_a_usage_error_naming_it(tmp_path, capsys, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 9:
        pytest.skip("this machine has the device")
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this build computes on CUDA")
    with probe.mode("dump", out=tmp_path / "r"):
        (torch.ones(3) * 2).exp()
    op_id = probe.load(tmp_path / "r").ops(0)[-1].id
    capsys.readouterr()
    # Before: --device bogus exited 0 with every op "failed", --device cuda in a traceback.
    for argv in (["replay", str(tmp_path / "r"), "--device", device],
                 ["replay", str(tmp_path / "r"), op_id, "--device", device]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"device {device!r}" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ProbeError, match=f"device {device!r}"):
        probe.replay_step(tmp_path / "r", device=device)
