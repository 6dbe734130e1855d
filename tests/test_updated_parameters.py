"""Each optimizer op is labelled with the parameter it works for, and compare pairs them by it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import probe
from probe.rundir.run import Run


class Stack(nn.Module):
    """Layers of one shape, so that two parameters' updates have the same ops and shapes; the
    first is read by no op, so its gradient stays None unless the loop sets one."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(16, 16)
        self.layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _train(out: Path, steps: int, optimizer: str = "adamw", foreach: bool = False,
           zero_unused: bool = False, scale_layer: int | None = None, last_lr: float = 1e-2) -> None:
    """``steps`` steps under the stats mode. ``zero_unused``: the unused layer gets zero gradients
    (what a compiled backward gives where eager leaves None), so the optimizer updates two more
    parameters. ``scale_layer``: that layer's output x1.5 from step 1 (a planted fault)."""
    torch.manual_seed(0)
    model = Stack()
    step = [0]
    if scale_layer is not None:
        layer = model.layers[scale_layer]
        layer.register_forward_hook(lambda m, i, o: o * 1.5 if step[0] >= 1 else o)
    last = set(model.layers[2].parameters())
    params = [{"params": [p for p in model.parameters() if p not in last]},
              {"params": list(model.layers[2].parameters()), "lr": last_lr}]
    opt = (torch.optim.AdamW(params, lr=1e-2, foreach=foreach) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach))
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=out, model=model) as session:
        for _ in range(steps):
            model(torch.randn(8, 16, generator=gen)).square().mean().backward()
            if zero_unused:
                for p in model.unused.parameters():
                    p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            session.step()
            step[0] += 1


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_optimizer_op_names_the_parameter_it_updates(tmp_path: Path, optimizer: str) -> None:
    _train(tmp_path / "run", 2, optimizer)
    run = Run(tmp_path / "run")
    names = {f"layers.{i}.{kind}" for i in range(3) for kind in ("weight", "bias")}
    for step in (0, 1):
        ops = [op for op in run.ops(step) if op.phase == "optimizer"]
        labelled = Counter(op.parameter for op in ops if op.parameter is not None)
        # The six parameters with gradients, each with the same ops; none for the unused layer.
        assert set(labelled) == names, (step, labelled)
        assert len(set(labelled.values())) == 1, (step, labelled)
        # Every op that reads a parameter's value, gradient or state is labelled (at step 0 only
        # the creation of AdamW's step counters reads none of them).
        unlabelled = [op.name for op in ops if op.parameter is None]
        assert all(name == "aten.lift_fresh.default" for name in unlabelled), unlabelled
        assert all(op.parameter is None for op in run.ops(step) if op.phase != "optimizer")
    # The label follows the parameter's own ops: the in-place update writes that parameter.
    update = next(op for op in run.ops(1) if op.phase == "optimizer" and op.parameter == "layers.1.bias"
                  and op.outputs and op.outputs[0].mutated and op.outputs[0].shape == (16,))
    assert update.parameter == "layers.1.bias"


def test_a_foreach_op_of_several_parameters_is_not_labelled(tmp_path: Path) -> None:
    _train(tmp_path / "run", 1, foreach=True)
    ops = [op for op in Run(tmp_path / "run").ops(0) if op.phase == "optimizer"]
    assert any(op.name.startswith("aten._foreach_") for op in ops)
    assert all(op.parameter is None for op in ops if op.name.startswith("aten._foreach_"))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_optimizer_that_updates_more_parameters_in_one_run_is_no_divergence(
        tmp_path: Path, optimizer: str) -> None:
    """Run B gives the unused layer zero gradients: its optimizer updates two more parameters,
    of the same shapes as the others, before them. Numbered per op name, B's n-th ``addcdiv_``
    was another parameter's than A's n-th, and compare called the pair divergent at step 0."""
    _train(tmp_path / "a", 2, optimizer)
    _train(tmp_path / "b", 2, optimizer, zero_unused=True)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.first_divergence is None, report.conclusion
    # B's own updates are listed as its own, not dropped.
    only_b = [row for row in report.rows if row["op_a"] is None and row["op_b"]
              and row["op_b"].startswith("optimizer:")]
    assert only_b


def test_a_fault_is_still_found_beside_the_extra_updates(tmp_path: Path) -> None:
    _train(tmp_path / "a", 3)
    _train(tmp_path / "b", 3, zero_unused=True, scale_layer=1)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    op_a, op_b = report.first_divergence
    found = op_a if op_a is not None else op_b
    # The hook's product runs in the frame around layers.1, whose output it scales.
    assert (found.step, found.module, found.name) == (1, "layers", "aten.mul.Tensor"), report.conclusion
    assert found.inputs[0].source is not None


def test_a_divergence_in_the_optimizer_names_the_parameter_it_updates(tmp_path: Path) -> None:
    _train(tmp_path / "a", 2)
    _train(tmp_path / "b", 2, last_lr=3e-2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    op_a, _ = report.first_divergence
    assert (op_a.step, op_a.phase, op_a.parameter) == (0, "optimizer", "layers.2.weight"), report.conclusion
    assert "in <outside modules>: the optimizer's update of layers.2.weight (rule:" in report.conclusion


def test_a_parameter_no_module_holds_is_named_by_its_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    scale = nn.Parameter(torch.ones(4))  # a loose tensor the optimizer updates beside the model
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [scale], "lr": 0.1}], lr=0.1)
    with probe.mode("structure", out=tmp_path / "run", model=model) as session:
        (model(torch.randn(2, 4)) * scale).sum().backward()
        opt.step()
        session.step()
    labels = {op.parameter for op in Run(tmp_path / "run").ops(0) if op.phase == "optimizer"}
    assert labels == {"weight", "bias", "param_groups[1][0]"}
