"""What the tracer records, and which module and phase each op is attributed to."""

from __future__ import annotations

import torch
from torch import nn

import probe
from tests.conftest import OpLog, SharedBlockNet, train_steps


def _one_step_names(session_or_mode) -> None:
    torch.manual_seed(0)
    model = SharedBlockNet()
    with session_or_mode:
        train_steps(model, 1, session=session_or_mode if isinstance(session_or_mode, probe.Session) else None)


def _one_traced_step(tmp_path, checkpointed: bool = False) -> list[probe.OpRecord]:
    """Ops of one training step of the shared-block net under the stats mode."""
    torch.manual_seed(0)
    model = SharedBlockNet(checkpointed=checkpointed)
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        train_steps(model, 1, session=session)
    return probe.load(tmp_path / "r").ops(0)


def test_backward_and_optimizer_ops_recorded_and_probe_ops_never_logged(tmp_path):
    bare = OpLog()
    _one_step_names(bare)
    session = probe.mode("stats", out=tmp_path / "r", inputs=True)
    _one_step_names(session)
    run = probe.load(tmp_path / "r")
    names = [op.name for op in run.ops(0)]
    # Exactly the ops a bare passthrough mode sees (less the profiler's region
    # marks, skipped by design): stats kernels, flush and hooks add nothing.
    expected = [name for name in bare.names if not name.startswith("profiler.")]
    assert len(expected) < len(bare.names)
    assert names == expected
    phases = {op.phase for op in run.ops(0)}
    assert phases == {"forward", "backward", "optimizer"}


def test_backward_ops_attributed_to_the_forward_module_call(tmp_path):
    ops = _one_traced_step(tmp_path)
    gelu_fwd = [op for op in ops if op.name == "aten.gelu.default"]
    gelu_bwd = [op for op in ops if op.name == "aten.gelu_backward.default"]
    # The shared block is called twice: two distinct calls, in forward and backward.
    assert [(op.module, op.module_call, op.phase) for op in gelu_fwd] == [
        ("block.act", 0, "forward"),
        ("block.act", 1, "forward"),
    ]
    # Backward runs the second call first.
    assert [(op.module, op.module_call, op.phase) for op in gelu_bwd] == [
        ("block.act", 1, "backward"),
        ("block.act", 0, "backward"),
    ]
    assert gelu_bwd[0].module_stack == ["[0]", "block[1]", "block.act[1]"]
    # The weight gradient matmul of the head belongs to the head.
    head_bwd = [op for op in ops if op.phase == "backward" and op.name == "aten.mm.default"]
    assert {op.module for op in head_bwd} >= {"head", "block.fc", "inp"}


def test_checkpoint_recompute_is_labelled_and_mapped_to_its_forward_call(tmp_path):
    ops = _one_traced_step(tmp_path, checkpointed=True)
    recompute = [op for op in ops if op.phase == "recompute"]
    assert recompute, "checkpoint recompute ops were not recorded"
    assert {op.module for op in recompute} <= {"block", "block.fc", "block.act"}
    addmm = [(op.module, op.module_call) for op in recompute if op.name == "aten.addmm.default"]
    # Backward recomputes the second call first, and each recompute carries the
    # call index of the forward call it repeats.
    assert addmm == [("block.fc", 1), ("block.fc", 0)]
    gelu_bwd = [(op.module, op.module_call) for op in ops if op.name == "aten.gelu_backward.default"]
    assert gelu_bwd == [("block.act", 1), ("block.act", 0)]


def test_optimizer_ops_are_recognisable(tmp_path):
    ops = _one_traced_step(tmp_path)
    opt_ops = [op for op in ops if op.phase == "optimizer"]
    assert opt_ops and all(op.id.startswith("optimizer:optimizer.AdamW[0]:") for op in opt_ops)
    # The parameter updates (in-place ops on the weights) are among them, marked as written.
    assert any(op.name == "aten.addcdiv_.default" and op.outputs[0].mutated for op in opt_ops)
    # No optimizer op leaked into the forward or backward phases.
    assert not any(op.name.startswith("aten.addcdiv") for op in ops if op.phase != "optimizer")


def test_filters_select_ops_modules_phases_and_steps(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode(
        "stats", out=tmp_path / "r", model=model, ops=["addmm", "aten.gelu*"],
        modules=["block.*"], phases=["forward", "backward"], steps=[1],
    ) as session:
        train_steps(model, 2, session=session)
    run = probe.load(tmp_path / "r")
    assert run.steps == [1]
    ops = run.ops(1)
    names = {op.name for op in ops}
    assert names == {"aten.addmm.default", "aten.gelu.default", "aten.gelu_backward.default"}
    assert {op.module for op in ops} == {"block.fc", "block.act"}
    assert {op.phase for op in ops} == {"forward", "backward"}
    # Ids do not depend on the filters: the same op gets the same id unfiltered.
    with probe.mode("stats", out=tmp_path / "all", model=model) as session:
        train_steps(model, 1, session=session)
    all_ids = {op.id for op in probe.load(tmp_path / "all").ops(0)}
    assert {op.id for op in ops} <= all_ids


def test_module_called_outside_the_root_and_ops_outside_modules(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    loss_fn = nn.MSELoss()
    with probe.mode("stats", out=tmp_path / "r"):
        out = model(torch.randn(2, 4))
        loss = loss_fn(out, torch.zeros(2, 4)) * 2.0
        loss.backward()
    ops = probe.load(tmp_path / "r").ops(0)
    assert {op.module for op in ops if op.name == "aten.mse_loss.default"} == {"MSELoss"}
    mul = [op for op in ops if op.name == "aten.mul.Tensor" and op.phase == "forward"]
    assert mul and mul[0].module == "" and mul[0].module_stack == []
    assert {op.module for op in ops if op.name == "aten.threshold_backward.default"} == {"1"}


def test_structure_mode_records_the_same_ops_without_statistics(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("structure", out=tmp_path / "s", model=model) as session:
        train_steps(model, 1, session=session)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("stats", out=tmp_path / "t", model=model) as session:
        train_steps(model, 1, session=session)
    structure, stats = probe.load(tmp_path / "s").ops(0), probe.load(tmp_path / "t").ops(0)
    assert [op.id for op in structure] == [op.id for op in stats]
    assert all(t.stats is None for op in structure for t in op.outputs)
    assert not (tmp_path / "s" / "rank0" / "step0" / "stats.npy").exists()
