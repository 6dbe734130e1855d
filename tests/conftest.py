"""Shared fixtures: small real models and a bare dispatch mode to compare against."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from probe import errors
from probe.errors import ProbeWarning


@pytest.fixture(autouse=True)
def _quiet_probe_notices():
    # warn_once warns once per process: each test starts with none said, so a test that
    # expects a notice sees it whatever ran before it.
    errors._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)
        yield


class OpLog(TorchDispatchMode):
    """A bare passthrough mode that logs op names (what any dispatch mode would see)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class SharedBlockNet(nn.Module):
    """Calls the same block twice, with dropout, so RNG and repeated calls are exercised."""

    def __init__(self, width: int = 16, checkpointed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.block = Block(width)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(width, 3)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for _ in range(2):
            if self.checkpointed:
                x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
            else:
                x = self.block(x)
        return self.head(self.drop(x))


def train_steps(model: nn.Module, steps: int, session=None, seed: int = 0, optimizer: str = "adamw"):
    """Train ``model`` on fixed synthetic data, calling ``session.step()`` after each step.

    Returns the losses and the gradients of the last step.
    """
    gen = torch.Generator().manual_seed(seed)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        y = torch.randint(0, 3, (4,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if session is not None:
            session.step()
    return losses, grads


def train_in(session, steps: int = 2, model: nn.Module | None = None, seed: int = 0, tail: bool = False):
    """``steps`` training steps (:func:`train_steps`) of ``model`` (None: a fresh SharedBlockNet made
    after ``torch.manual_seed(seed)``) inside ``session``, entered and ended here (None: without a
    probe). ``tail``: then ``randn(3).exp().sum().item()`` after the last ``step()``, the run's tail.
    Returns ``(losses, last gradients, parameters after)``."""
    if model is None:
        torch.manual_seed(seed)
        model = SharedBlockNet()
    with session if session is not None else contextlib.nullcontext():
        losses, grads = train_steps(model, steps, session=session)
        if tail:
            torch.randn(3).exp().sum().item()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_modes(out, modes, steps: int = 2, seed: int = 0, tail: bool = False, **options) -> probe.Session:
    """``steps`` training steps (:func:`train_in`) of a fresh SharedBlockNet under
    ``probe.mode(modes, out=out, model=model, **options)``; the session, ended. ``tail``: then
    ``randn(3).exp().sum().item()`` after the last ``step()``, the run's tail."""
    torch.manual_seed(seed)
    model = SharedBlockNet()
    session = probe.mode(modes, out=out, model=model, **options)
    train_in(session, steps, model=model, tail=tail)
    return session


def sgd_autocast_pair(root, build, dtype: torch.dtype, tokens: int, width: int, fault: str | None = None,
                      widen_loss: bool = False) -> list:
    """Two steps of SGD of ``build()`` on fixed data (``tokens`` x ``width``): run A in fp32, run B
    under ``dtype`` autocast with ``fault`` (a module name: its output scaled by 1.5 at step 1,
    inside the module's call, as a bug in it). The loss is the output's mean square, widened to
    fp32 first with ``widen_loss``; else run B's loss is computed in ``dtype``."""
    runs = []
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = build()
        scaled = [False]
        if fault is not None and autocast:
            module = model.get_submodule(fault)
            forward = module.forward
            module.forward = lambda x, forward=forward, scaled=scaled: forward(x) * (1.5 if scaled[0] else 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))
        with probe.mode("stats", out=root / name, model=model) as session:
            for step in range(2):
                scaled[0] = step == 1
                with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                    out = model(x)
                    loss = (out.float() if widen_loss else out).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                session.step()
        runs.append(root / name)
    return runs


def train_under(session_factory, seed: int, checkpointed: bool = True):
    """Two training steps of a fresh SharedBlockNet, under ``session_factory(model)`` (None: no probe).

    Returns ``(losses, last gradients, parameters, CPU RNG state)`` for transparency checks.
    """
    torch.manual_seed(seed)
    model = SharedBlockNet(checkpointed=checkpointed)
    session = session_factory(model)
    if session is None:
        losses, grads = train_steps(model, 2)
    else:
        with session:
            losses, grads = train_steps(model, 2, session=session)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params, torch.get_rng_state()
