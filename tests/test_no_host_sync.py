"""No host sync inside a traced step: a sentinel mode below the probe watches every op it issues."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from tests.conftest import SharedBlockNet, train_steps

_SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default"}


class SyncSentinel(TorchDispatchMode):
    """Sits below the probe, so it sees the ops the probe's handlers issue."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs: list[str] = []
        self.device_to_host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = str(func)
        if name in _SYNC_OPS:
            self.syncs.append(name)
        if name in ("aten._to_copy.default", "aten.copy_.default"):
            src = args[1] if name == "aten.copy_.default" else args[0]
            dst_device = kwargs.get("device") if name == "aten._to_copy.default" else args[0].device
            if src.device.type != "cpu" and dst_device is not None and torch.device(dst_device).type == "cpu":
                self.device_to_host.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("backend", ["auto", "compiled", "eager"])
def test_stats_mode_issues_no_host_sync_inside_a_step(tmp_path, backend):
    torch.manual_seed(0)
    model = SharedBlockNet()
    torch.manual_seed(0)
    reference_model = SharedBlockNet()

    # SGD issues no sync of its own, so any sync the sentinel sees is the probe's.
    baseline = SyncSentinel()
    with baseline:
        train_steps(reference_model, 1, optimizer="sgd")
    assert baseline.syncs == []

    sentinel = SyncSentinel()
    session = probe.mode("stats", out=tmp_path / "r", model=model, inputs=True, stats_backend=backend)
    with sentinel, session:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 8, generator=gen)
        y = torch.randint(0, 3, (4,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=1e-2).step()
        ops_before_flush = sentinel.ops
        syncs_in_step = list(sentinel.syncs)
        session.step()
    # The stats kernels ran below the probe, in view of the sentinel ...
    assert ops_before_flush > baseline.ops
    # ... and none of them synchronised with the host.
    assert syncs_in_step == []
    assert sentinel.device_to_host == []
    assert probe.load(tmp_path / "r").ops(0)
