"""Rewind: one planted fault per verdict, and training going on bit-identical after a rewind."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import probe
from probe.cli import main
from probe.rewind import read_verdicts, rewinder_of
from probe.tracer.mode_stack import untraced

BAD_STEP = 2


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)).to(dtype)


def _batches(dtype: torch.dtype = torch.float32, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=generator).to(dtype),
             torch.randn(6, 1, generator=generator).to(dtype)) for _ in range(n)]


@pytest.fixture(params=[1, 3], ids=["kept-every-step", "kept-every-3-steps"])
def keep_every(request: pytest.FixtureRequest) -> int:
    """Each verdict the same whether every step's start is copied or every third one's (step 2's start
    is then step 0's with steps 0 and 1 replayed)."""
    return request.param


def _train(model: nn.Module, batches: list, out: Path, rewind_after: int | None = None,
           keep_every: int = 1) -> list:
    # eps 1e-4: AdamW's 1e-8 is 0 in fp16, which the fp16 case would find at step 0 (rightly: precision).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)

    def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss

    verdicts = []
    with probe.mode("stats", out=out, model=model) as session:
        for step, batch in enumerate(batches):
            session.step_fn(fn, batch, optimizer=optimizer, keep_every=keep_every)
            if step == rewind_after:
                verdicts.append(session.rewind())
    return verdicts + read_verdicts(out)


def test_bit_flip_once_is_transient_and_the_op_it_reached_is_named(tmp_path: Path, keep_every: int) -> None:
    model = _mlp()
    calls = []

    def flip_once(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == BAD_STEP + 1:  # the forward of step 2, once: the reruns do not see it
            with untraced():  # a hardware fault: no op of the program made it
                output.detach().view(-1).view(torch.int32)[0] ^= 1 << 30

    model[0].register_forward_hook(flip_once)
    verdicts = _train(model, _batches(), tmp_path / "run", keep_every=keep_every)
    [verdict] = verdicts
    assert (verdict.step, verdict.verdict, verdict.trigger) == (BAD_STEP, "transient", "non-finite loss")
    # The flip happened after linear 0's addmm was recorded: the first values that differ are the ReLU's.
    assert verdict.located is not None
    assert (verdict.located["module"], verdict.located["name"]) == ("1", "aten.relu.default")
    assert verdict.reruns[0].bitwise_equal is False and verdict.reruns[0].nonfinite is None
    # A second rerun equals the first: the original alone differed, a one-off.
    assert verdict.cause == "hardware", verdict.evidence
    assert [(r.kind, r.bitwise_equal) for r in verdict.reruns] == [("same", False), ("same again", True)]
    assert "transient (hardware)" in verdict.line()


def test_fp16_overflow_float64_avoids_is_precision_named_at_the_op_that_overflowed(tmp_path: Path,
                                                                                  keep_every: int) -> None:
    model = _mlp(torch.float16)
    batches = _batches(torch.float16)
    x, y = batches[BAD_STEP]
    batches[BAD_STEP] = (x * 3000, y)  # the squared error passes fp16's 65504; float64 holds it
    [verdict] = _train(model, batches, tmp_path / "run", keep_every=keep_every)
    assert verdict.verdict == "precision", verdict.why
    assert verdict.located is not None
    assert (verdict.located["name"], verdict.located["module"]) == ("aten.pow.Tensor_Scalar", "")
    assert [r.kind for r in verdict.reruns] == ["same", "float64"]
    assert verdict.reruns[1].nonfinite is None and verdict.reruns[0].nonfinite is not None


def test_poisoned_sample_is_data_and_named(tmp_path: Path, keep_every: int) -> None:
    batches = _batches()
    x, y = batches[BAD_STEP]
    x = x.clone()
    x[3, 1] = float("inf")  # one sample poisoned: no precision holds it
    batches[BAD_STEP] = (x, y)
    [verdict] = _train(_mlp(), batches, tmp_path / "run", keep_every=keep_every)
    assert verdict.verdict == "data", verdict.why
    assert verdict.samples == [3]
    assert [r.kind for r in verdict.reruns] == ["same", "float64", "previous_batch"]
    assert verdict.sample_losses[3] is None and all(v is not None for i, v in enumerate(verdict.sample_losses)
                                                     if i != 3)


@pytest.mark.parametrize("given", [True, False])
def test_a_scheduler_the_step_advances_is_put_back_after_the_reruns(tmp_path: Path, given: bool) -> None:
    """``fn`` steps a LambdaLR (its rate a function of the steps counted): the rewind's four reruns of
    step 2 step it too. Given as ``scheduler=``, training after the rewind has the schedule of a run
    without the probe; not given, a warning says to pass it."""
    def train(traced: bool) -> tuple[int, float]:
        model = _mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda steps: 1 / (1 + steps))

        def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            optimizer.zero_grad()
            loss = ((model(batch[0]) - batch[1]) ** 2).mean()
            loss.backward()
            optimizer.step()
            scheduler.step()
            return loss

        batches = _batches()
        batches[BAD_STEP][0][3, 1] = float("inf")
        if not traced:
            for batch in batches:
                fn(batch)
        else:
            with probe.mode("stats", out=tmp_path / "run", model=model) as session:
                state = {"optimizer": optimizer, **({"scheduler": scheduler} if given else {})}
                for batch in batches:
                    session.step_fn(fn, batch, **state)
            assert [v.verdict for v in read_verdicts(tmp_path / "run")] == ["data"]
        return scheduler.last_epoch, optimizer.param_groups[0]["lr"]

    untraced_schedule = train(traced=False)
    if given:
        assert train(traced=True) == untraced_schedule == (4, 1e-2 / 5)
    else:
        with pytest.warns(probe.ProbeWarning, match="scheduler="):
            assert train(traced=True) != untraced_schedule


def test_scheduler_without_state_dict_is_refused_naming_it(tmp_path: Path) -> None:
    model = _mlp()
    with probe.mode("stats", out=tmp_path / "run", model=model) as session, \
            pytest.raises(probe.ProbeError, match=r"scheduler=.*state_dict"):
        session.step_fn(lambda batch: None, _batches()[0], scheduler=[object()])


class _WarmupThatRunsOut(nn.Module):
    """Scales its output by sqrt(warmup - calls): the code, not the data, goes negative at step 2."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sqrt(1.5 - self.calls)
        with torch.no_grad():
            self.calls += 1
        return self.body(x) * scale


def test_nan_made_by_a_condition_of_the_code_is_code_named_at_its_op(tmp_path: Path, keep_every: int) -> None:
    [verdict] = _train(_WarmupThatRunsOut(), _batches(), tmp_path / "run", keep_every=keep_every)
    assert verdict.verdict == "code", verdict.why
    assert verdict.located is not None
    assert (verdict.located["name"], verdict.located["module"]) == ("aten.sqrt.default", "")
    assert [r.kind for r in verdict.reruns] == ["same", "float64", "previous_batch"]
    assert all(r.nonfinite is not None for r in verdict.reruns)


def _state(model: nn.Module, optimizer_state: dict) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer_state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def test_training_after_a_rewind_is_bit_identical_to_training_without_it(tmp_path: Path,
                                                                          keep_every: int) -> None:
    def run(out: Path, rewind_after: int | None) -> tuple[list[torch.Tensor], torch.Tensor, Any, Any, list]:
        torch.manual_seed(0)
        random.seed(0)
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)  # grows every step

        def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch
            optimizer.zero_grad()
            noise = random.random() + float(np.random.rand())  # every RNG the step reads
            loss = ((model(x) - y) ** 2).mean() * (1 + noise)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            return loss

        verdicts = []
        with probe.mode("stats", out=out, model=model) as session:
            for step, batch in enumerate(_batches(n=4)):  # step 1 rewound, then steps 2 and 3
                # keep_every=3: step 1's start is step 0's, step 0 replayed (its RNG draws included)
                session.step_fn(fn, batch, optimizer=optimizer, scaler=scaler, keep_every=keep_every)
                if step == rewind_after:
                    verdicts.append(session.rewind())
        return ([*_state(model, optimizer.state), scaler.get_scale() * torch.ones(())], torch.get_rng_state(),
                random.getstate(), np.random.get_state()[1].copy(), verdicts)

    plain = run(tmp_path / "plain", None)
    rewound = run(tmp_path / "rewound", 1)
    [verdict] = rewound[4]
    assert verdict.verdict == "reproducible" and verdict.reruns[0].bitwise_equal
    assert len(plain[0]) == len(rewound[0]) > 4
    for a, b in zip(plain[0], rewound[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain[1], rewound[1])
    assert plain[2] == rewound[2]
    assert np.array_equal(plain[3], rewound[3])


def test_probe_summary_prints_the_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    batches = _batches()
    x, y = batches[BAD_STEP]
    batches[BAD_STEP] = (x.clone().index_fill_(0, torch.tensor([3]), float("nan")), y)
    _train(_mlp(), batches, tmp_path / "run")
    assert main(["summary", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "step 2 rank 0: rewound (non-finite loss): data: sample(s) 3 of the batch" in printed


def _adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """A training step for ``step_fn``: squared error, backward, the optimizer's step."""
    def fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = ((model(batch[0]) - batch[1]) ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss

    return fn


def test_a_monitor_alert_rewinds_the_step_it_is_about(tmp_path: Path) -> None:
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fn = _adamw_step(model, optimizer)

    def spike_at_step_1(observation: Any) -> str | None:  # a finite alert: no NaN to rewind on
        return "planted" if observation.step == 1 and observation.series.slot == "output" else None

    with probe.mode("monitor", targets=["0"], anomaly_rules=[spike_at_step_1], out=tmp_path / "run",
                    model=model) as session:
        for batch in _batches():
            session.step_fn(fn, batch, optimizer=optimizer)
            # The loop's own work between steps (a data loader drawing its seed, gradients freed) is no
            # part of the step: the rerun of a step a monitor alert is about is compared with its end.
            torch.randint(0, 2**62, ())
            optimizer.zero_grad(set_to_none=True)
    [verdict] = read_verdicts(tmp_path / "run")
    assert verdict.step == 1 and verdict.trigger.startswith("monitor rule:"), verdict.trigger
    assert verdict.verdict == "reproducible", verdict.why


def test_the_verdict_is_a_series_in_the_monitors_csv_and_tensorboard(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches()
    x, y = batches[BAD_STEP]
    batches[BAD_STEP] = (x.clone().index_fill_(0, torch.tensor([3]), float("inf")), y)

    fn = _adamw_step(model, optimizer)

    with probe.mode("monitor", targets=["0"], tensorboard=True, out=tmp_path / "run", model=model) as session:
        for batch in batches:
            session.step_fn(fn, batch, optimizer=optimizer)
    [verdict] = read_verdicts(tmp_path / "run")
    assert (verdict.step, verdict.verdict) == (BAD_STEP, "data")
    run = probe.load(tmp_path / "run")
    for step in run.steps:
        rewound = [(r.name, r.mean, r.numel) for r in run.monitor(step) if r.kind == "rewind"]
        assert rewound == ([("data", 1.0, 1.0)] if step == BAD_STEP else []), step
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "rank0" / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("rewind/data/mean")] == [(BAD_STEP, 1.0)]
    assert len(events.Scalars("activation/0/output/mean")) == len(batches)  # the step's own series stay


class _ReadsAGlobalCounter(nn.Module):
    """Adds a value that changes every forward, from outside anything a step's start holds (a Python
    global, as the clock or an unseeded generator would be); ``kernel_like``: only while torch's
    deterministic algorithms are off, as an atomic-add reduction on an accelerator."""

    forwards = 0

    def __init__(self, kernel_like: bool) -> None:
        super().__init__()
        self.body = _mlp()
        self.kernel_like = kernel_like

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _ReadsAGlobalCounter.forwards += 1
        if self.kernel_like and torch.are_deterministic_algorithms_enabled():
            return self.body(x)
        return self.body(x) + 1e-3 * _ReadsAGlobalCounter.forwards


@pytest.fixture(params=[False, True], ids=["flags-free", "flags-frozen"])
def backend_flags(request: pytest.FixtureRequest) -> Any:
    """The backend flags as a fresh process has them, and frozen as torch's test utilities (imported
    by torch.distributed's fake process group, say) leave them: assigning ``cudnn.benchmark`` raises."""
    frozen = torch.backends.flags_frozen()
    if request.param:
        torch.backends.disable_global_flags()
    yield request.param
    torch.backends.__allow_nonbracketed_mutation_flag = not frozen


@pytest.mark.parametrize(("kernel_like", "cause"), [(False, "non-determinism (program)"),
                                                     (True, "non-determinism (kernel)")])
def test_a_step_that_does_not_reproduce_itself_is_non_determinism_kernel_or_program(
        tmp_path: Path, kernel_like: bool, cause: str, backend_flags: bool) -> None:
    verdicts = _train(_ReadsAGlobalCounter(kernel_like), _batches(), tmp_path / "run", rewind_after=1)
    verdict = verdicts[0]
    assert (verdict.step, verdict.verdict, verdict.cause) == (1, "transient", cause), verdict.evidence
    assert [(r.kind, r.bitwise_equal) for r in verdict.reruns] == [
        ("same", False), ("same again", False), ("deterministic", None),
        ("deterministic again", kernel_like)]
    # The op named is the first whose values differ between the two reruns: the add reading the counter.
    assert verdict.located is not None
    assert (verdict.located["name"], verdict.located["module"]) == ("aten.add.Tensor", ""), verdict.located
    assert "between the two reruns" in verdict.located["how"]
    assert not torch.are_deterministic_algorithms_enabled()  # the flag as it was
    assert not torch.backends.cudnn.benchmark


def test_a_replay_that_does_not_reproduce_its_step_is_not_classified(tmp_path: Path) -> None:
    """keep_every=3: step 1's start is step 0's with step 0 replayed; step 0 reads a counter held outside
    the model, so its replay gives another loss. The start of step 1 is then unknown: no verdict is
    made from it, and training goes on from the original's end."""
    model = _ReadsAGlobalCounter(False)
    verdicts = _train(model, _batches(), tmp_path / "run", rewind_after=1, keep_every=3)
    verdict = verdicts[0]
    assert (verdict.step, verdict.verdict) == (1, "not classified")
    assert "replaying step 0 from the start kept at step 0" in verdict.why and "not known" in verdict.why
    assert verdict.reruns == []


def test_the_loops_own_draws_and_schedule_between_steps_are_replayed_as_they_were(tmp_path: Path) -> None:
    """Between steps the loop draws from torch's RNG (a sampler) and steps an LR scheduler, outside
    ``fn``. Each step's boundary keeps both, so step 4, started from step 3's kept start (keep_every=3),
    replays to the original's start: the rerun is bit for bit the original, and training after the
    rewind is that of a run without the probe. Host memory: one copy of the state, 4 batches."""
    def run(traced: bool) -> tuple[list[torch.Tensor], Any, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        fn = _adamw_step(model, optimizer)
        verdicts = []
        session = probe.mode("stats", out=tmp_path / f"run-{traced}", model=model) if traced else None
        with contextlib.ExitStack() as stack, warnings.catch_warnings():
            warnings.simplefilter("ignore", probe.ProbeWarning)  # the scheduler is stepped outside fn
            if session is not None:
                stack.enter_context(session)
            for step, batch in enumerate(_batches(n=7)):
                if session is None:
                    fn(batch)
                else:
                    session.step_fn(fn, batch, optimizer=optimizer, keep_every=3)
                    if step == 4:
                        verdicts.append(session.rewind())
                        interval = rewinder_of(session).interval
                        assert interval is not None
                        state = sum(t.numel() * t.element_size() for t in _state(model, optimizer.state))
                        batch_bytes = sum(t.numel() * t.element_size() for t in batch)
                        assert interval.nbytes() <= state + 4 * batch_bytes
                scheduler.step()
                torch.rand(3)
        return _state(model, optimizer.state), torch.get_rng_state(), verdicts

    plain, plain_rng, _ = run(False)
    rewound, rewound_rng, [verdict] = run(True)
    assert verdict.verdict == "reproducible", verdict.why
    assert verdict.reruns[0].bitwise_equal
    assert all(torch.equal(a, b) for a, b in zip(plain, rewound, strict=True))
    assert torch.equal(plain_rng, rewound_rng)


def test_a_weight_written_between_steps_makes_that_steps_start_a_whole_copy(tmp_path: Path) -> None:
    """keep_every=3, and the loop scales a weight in place between steps 1 and 2, outside ``fn``: a
    replay from step 0 could not make that write, so step 2's start is copied whole (its version
    counter moved since step 1 ended) and the rewind of step 2 reproduces it."""
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fn = _adamw_step(model, optimizer)
    with probe.mode("stats", out=tmp_path / "run", model=model) as session:
        for step, batch in enumerate(_batches(n=3)):
            if step == 2:
                with torch.no_grad():
                    model[0].weight.mul_(1.5)
            session.step_fn(fn, batch, optimizer=optimizer, keep_every=3)
        interval = rewinder_of(session).interval
        assert interval is not None and interval.replayed(2) is None
        verdict = session.rewind()
    assert (verdict.step, verdict.verdict) == (2, "reproducible"), verdict.why


@pytest.mark.parametrize("bad", [0, -2, 2.5, "3", True])
def test_keep_every_that_is_no_count_of_steps_is_refused_naming_it(tmp_path: Path, bad: Any) -> None:
    model = _mlp()
    with probe.mode("stats", out=tmp_path / "run", model=model) as session, \
            pytest.raises(probe.ProbeError, match=rf"keep_every={bad!r}"):
        session.step_fn(lambda batch: None, _batches()[0], keep_every=bad)


def _rewind_ranks(tmp_path: Path, wrap: str) -> Path:
    """tests/distributed/rewind_worker.py on two gloo ranks; the directory of their reports."""
    pytest.importorskip("torch.distributed")
    worker = Path(__file__).parent / "distributed" / "rewind_worker.py"
    report = tmp_path / "report"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(worker), "--out", str(tmp_path / "run"), "--report", str(report), "--wrap", wrap]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return report


@pytest.mark.parametrize("wrap", ["none", "ddp"])
def test_ranks_rewind_together_and_the_verdict_names_the_rank(tmp_path: Path, wrap: str) -> None:
    """Two gloo ranks, gradients all-reduced inside the step (by hand, or by DDP's reducer): rank 1's
    poisoned sample makes rank 1's loss and both ranks' parameters non-finite; both rewind together
    (their reruns' all-reduces meet: no hang) and both name rank 1's sample."""
    report = _rewind_ranks(tmp_path, wrap)
    for rank in (0, 1):
        [verdict] = json.loads((report / f"rank{rank}.json").read_text())["verdicts"]
        assert (verdict["step"], verdict["rank"], verdict["verdict"]) == (2, rank, "data"), verdict["why"]
        assert verdict["ranks"] == [1]
        assert verdict["samples"] == ([3] if rank == 1 else [])
        assert verdict["trigger"] == ("non-finite parameter after the step on rank 0, "
                                      "non-finite loss on rank 1")
    [written] = [v for v in read_verdicts(tmp_path / "run") if v.rank == 1]
    assert "data on rank 1: sample(s) 3 of the batch" in written.line()


def test_fsdp2_sharded_state_is_kept_by_shard_and_the_precision_rerun_refused(tmp_path: Path) -> None:
    """FSDP2 (fully_shard): parameters, gradients and AdamW's moments are DTensors. Each rank keeps
    and puts back its own shard (the keep raised into training before), and the reruns run; the
    float64 rerun cannot upcast sharded parameters in place, so the verdict says so instead of
    guessing, with rank 1's first non-finite op, the first layer's addmm reading the inf."""
    report = _rewind_ranks(tmp_path, "fsdp")
    for rank in (0, 1):
        [verdict] = json.loads((report / f"rank{rank}.json").read_text())["verdicts"]
        assert (verdict["step"], verdict["verdict"]) == (2, "not classified"), verdict["why"]
        assert "fully_shard" in verdict["why"] and "float64" in verdict["why"]
    located = json.loads((report / "rank1.json").read_text())["verdicts"][0]["located"]
    assert (located["name"], located["module"]) == ("aten.addmm.default", "0")
