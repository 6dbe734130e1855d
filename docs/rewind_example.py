"""One planted fault per rewind verdict, on a tiny MLP (CPU, seconds): python docs/rewind_example.py OUT.

Each case trains 4 steps through ``session.step_fn``; step 2 goes non-finite and is rewound on its
own. Prints each verdict line, then ``probe summary`` of the last run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import probe
from probe.cli import main as cli_main
from probe.tracer.mode_stack import untraced

BAD = 2


def mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)


def batches(dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=g).to(dtype), torch.randn(6, 1, generator=g).to(dtype))
            for _ in range(4)]


def train(model: nn.Module, data: list, out: Path) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # 1e-8 is 0 in fp16

    def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # forward, backward, update
        x, y = batch
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss

    with probe.mode("stats", out=out, model=model, overwrite=True) as session:
        for batch in data:
            session.step_fn(fn, batch, optimizer=optimizer)  # the loop's one call
    for verdict in probe.rewind.read_verdicts(out):
        print(verdict.line())


def transient(out: Path) -> None:
    """A bit flipped once in linear 0's output (a hook standing in for faulty hardware)."""
    model, calls = mlp(), []

    def flip_once(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == BAD + 1:
            with untraced():  # no op of the program made it
                output.detach().view(-1).view(torch.int32)[0] ^= 1 << 30

    model[0].register_forward_hook(flip_once)
    train(model, batches(), out)


def non_determinism(out: Path) -> None:
    """An add fed by a counter outside the model (as the clock, or a racing kernel, would be): each
    run of a step differs, and in the original step 2 the value it added was inf."""
    model, forwards = mlp(), [0]

    def counter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        forwards[0] += 1
        return output + (float("inf") if forwards[0] == BAD + 1 else 1e-3 * forwards[0])

    model[0].register_forward_hook(counter)
    train(model, batches(), out)


def precision(out: Path) -> None:
    """fp16 whose squared error passes 65504 at step 2; float64 holds it."""
    data = batches(torch.float16)
    data[BAD] = (data[BAD][0] * 3000, data[BAD][1])
    train(mlp(torch.float16), data, out)


def data_fault(out: Path) -> None:
    """Sample 3 of batch 2 poisoned with inf."""
    data = batches()
    x = data[BAD][0].clone()
    x[3, 1] = float("inf")
    data[BAD] = (x, data[BAD][1])
    train(mlp(), data, out)


class WarmupThatRunsOut(nn.Module):
    """Scales its output by sqrt(1.5 - forward calls): negative at step 2, whatever the data."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt(1.5 - self.calls)
        with torch.no_grad():
            self.calls += 1
        return self.body(x) * scale


def code(out: Path) -> None:
    train(WarmupThatRunsOut(), batches(), out)


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/rewind")
    for case in (transient, non_determinism, precision, data_fault, code):
        case(root / case.__name__)
    sys.exit(cli_main(["summary", str(root / "code")]))
