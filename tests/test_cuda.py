"""On a CUDA device: the passive modes stay bit-identical, issue no host sync inside
a step (CUDA's own sync detector, in error mode, watches every op), and compute
the same statistics the CPU computes. Skipped where there is no CUDA device."""

from __future__ import annotations

import math

import pytest
import torch

import probe
from probe.demo.model import LlamaConfig, synthetic_batch
from probe.demo.train import DemoTraining

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PASSIVE = {
    "stats": {},
    "dump": {},
    "free_benchmark": {"perturb": "add_noise"},
    "free_benchmark-backward": {"perturb": "bit_noise", "phases": ["backward"]},
}
# Wide enough that the compiled kernels (statistics, perturbations) run, not only the eager ones.
CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_layers=2, num_heads=4)


def _train(steps: int, session_for=None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    training = DemoTraining(CONFIG, batch=4, seq=64, device="cuda")
    session = session_for(training.model) if session_for else None
    losses = []
    if session is None:
        losses = [training.step() for _ in range(steps)]
    else:
        with session:
            for _ in range(steps):
                losses.append(training.step())
                session.step()
    params = {n: p.detach().clone() for n, p in training.model.named_parameters()}
    return losses, params, torch.cuda.get_rng_state()


@pytest.mark.parametrize("name", sorted(PASSIVE))
def test_passive_modes_are_bitwise_transparent_on_cuda(tmp_path, name):
    mode = name.split("-")[0]
    plain = _train(2)
    traced = _train(2, lambda m: probe.mode(mode, out=tmp_path / "run", model=m, **PASSIVE[name]))
    for a, b in zip(plain[0], traced[0], strict=True):
        assert torch.equal(a, b)
    for key in plain[1]:
        assert torch.equal(plain[1][key], traced[1][key]), key
    assert torch.equal(plain[2], traced[2])
    run = probe.load(tmp_path / "run")
    assert run.steps == [0, 1]
    if mode == "free_benchmark":
        checks = run.checks(1)
        assert checks and sum(c.verdict == "fail" for c in checks) <= len(checks) // 50


def _step_without_sync(training: DemoTraining) -> None:
    """A training step under CUDA's sync detector in error mode; the batch is copied
    to the device before (a copy from pageable host memory is itself a sync)."""
    tokens = synthetic_batch(training.config, training.batch, training.seq, training.data).to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        training.model.loss(tokens).backward()
        training.optimizer.step()
        training.optimizer.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("name", sorted(PASSIVE))
def test_no_host_sync_inside_a_traced_step_on_cuda(tmp_path, name):
    mode = name.split("-")[0]
    training = DemoTraining(CONFIG, batch=4, seq=64, device="cuda")
    training.step()  # AdamW's lazy state
    _step_without_sync(training)  # the step itself issues none: any sync below is the probe's
    # The detector is process-wide: with the default asynchronous flush it would also
    # catch the writer thread copying the previous step's results to the host while
    # this step runs (a wait on that thread, not on training); flush synchronously.
    session = probe.mode(mode, out=tmp_path / "run", model=training.model, async_flush=False, **PASSIVE[name])
    with session:
        training.step()
        session.step()  # the first traced step compiles the probe's kernels
        _step_without_sync(training)
        session.step()  # the step's one transfer happens here, after the step
    assert probe.load(tmp_path / "run").steps == [0, 1]


def test_cuda_statistics_match_a_cpu_recomputation(tmp_path):
    training = DemoTraining(CONFIG, batch=4, seq=64, device="cuda")
    with probe.mode(["stats", "dump"], out=tmp_path / "run", model=training.model) as session:
        training.step()
        session.step()
    run = probe.load(tmp_path / "run")
    checked = 0
    for op in run.ops(0):
        for i, out in enumerate(op.outputs):
            if out.stats is None or not out.dtype.startswith("float") or math.prod(out.shape) == 0:
                continue
            tensor = run.tensor(op.id, "output", i).double()
            assert out.stats["max"] == pytest.approx(tensor.max().item(), rel=1e-6, abs=1e-30), op.id
            assert out.stats["min"] == pytest.approx(tensor.min().item(), rel=1e-6, abs=1e-30), op.id
            assert out.stats["norm"] == pytest.approx(tensor.norm().item(), rel=1e-4), op.id
            assert out.stats["mean"] == pytest.approx(tensor.mean().item(), rel=1e-4, abs=1e-6), op.id
            checked += 1
    assert checked > 100


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs NCCL")
def test_nccl_all_reduce_statistics_are_taken_after_the_wait(tmp_path):
    """A one-rank NCCL group: the all-reduce runs on NCCL's stream; its statistics must be
    of the reduced value (the wait orders the current stream after it), not of a later write."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        t = torch.full((1 << 20,), 2.0, device="cuda")
        with probe.mode("stats", out=tmp_path / "r") as session:
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            t.mul_(3)
            dist.all_reduce(t)  # synchronous form
            t.add_(1)
            session.step()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
    run = probe.load(tmp_path / "r")
    reduced = [op for op in run.ops() if op.name == "c10d.allreduce_.default"]
    assert [op.outputs[0].stats["max"] for op in reduced] == [2.0, 6.0]
    assert all(op.group == {"size": 1, "name": op.group["name"], "ranks": [0]} for op in reduced)
    assert run.process(0)["backend"] == "nccl" and run.process(0)["device"] == "cuda:0"
