"""Training the demo model for a few steps, with or without a probe session."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from probe.demo.model import LlamaConfig, TinyLlama, synthetic_batch


@dataclass
class DemoTraining:
    """Model, optimizer and data stream of the demo, built before any probe is entered."""

    config: LlamaConfig = field(default_factory=LlamaConfig)
    batch: int = 4
    seq: int = 32
    seed: int = 0
    dtype: torch.dtype = torch.float32
    foreach: bool | None = None
    """AdamW's ``foreach``; None is torch's default choice for the device."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        torch.manual_seed(self.seed)
        self.model = TinyLlama(self.config).to(device=self.device, dtype=self.dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=self.foreach)
        self.data = torch.Generator().manual_seed(self.seed + 1)

    def step(self) -> torch.Tensor:
        """One training step; returns the (detached) loss."""
        tokens = synthetic_batch(self.config, self.batch, self.seq, self.data).to(self.device)
        loss = self.model.loss(tokens)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def synchronize(self) -> None:
        """Waits for the device's queued work: call before reading a clock."""
        if torch.device(self.device).type != "cpu":
            torch.accelerator.synchronize()


def train(
    training: DemoTraining,
    steps: int,
    session: Any = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Run ``steps`` steps; with a session, enter it and call ``session.step()`` after each."""
    losses: list[float] = []

    def loop() -> None:
        for step in range(steps):
            loss = training.step()
            losses.append(loss.item())
            if session is not None:
                session.step()
            if on_step is not None:
                on_step(step, losses[-1])

    if session is None:
        loop()
    else:
        with session:
            loop()
    return losses
