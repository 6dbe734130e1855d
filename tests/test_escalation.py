"""The monitor arms the per-op modes after an anomaly (``on_anomaly="trace"``, probe.escalation)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import probe
from probe import ProbeError
from probe.analysis.escalations import escalation_links
from probe.modes.stats.file_names import STATS_FILE
from probe.rundir import layout
from probe.tracer.dispatch_mode import ProbeDispatchMode
from tests.hf_models import tiny_llama

LAYERS = ["model.layers.?"]  # the decoder layers' output and output gradient


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _plant_inf(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")


def _plant_spike(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(1e4)


def _train(steps: int, session: Any = None, plant: tuple[int, Callable] | None = None,
           around: Callable[[int], None] | None = None) -> list[str]:
    """Train a tiny Llama (seeded); ``plant`` = (step, fault) corrupts a weight before that step;
    ``around(step)`` runs at each step's start; a step with a non-finite loss skips the update.
    Returns, per step, the dispatch modes on the stack (type names) while it ran."""
    model = tiny_llama()
    if session is not None:
        session = session(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = _ids()
    seen = []
    with session if session is not None else contextlib.nullcontext() as s:
        for step in range(steps):
            if around is not None:
                around(step)
            if plant is not None and step == plant[0]:
                plant[1](model)
            loss = model(ids, labels=ids).loss
            seen.append(",".join(type(m).__name__ for m in _get_current_dispatch_mode_stack()))
            loss.backward()
            if torch.isfinite(loss):  # as a loss scaler does: a non-finite step leaves the weights alone
                opt.step()
            opt.zero_grad()
            if s is not None:
                s.step()
    return seen


def _monitor(out: Any, **options: Any) -> Callable[[torch.nn.Module], Any]:
    options = {"targets": LAYERS, "on_anomaly": "trace", "async_flush": False, **options}
    return lambda model: probe.mode("monitor", out=out, model=model, **options)


def _traced_steps(run: Any) -> list[int]:
    return [step for step in run.steps if run.ops(step, 0)]


def _spiking_session(out: Any, spikes: tuple[int, ...], **options: Any) -> tuple[Callable, Callable]:
    """A monitored session whose layer 1 output is x100 at the ``spikes`` steps (its ``around``)."""
    holder = {"on": False}

    def around(step: int) -> None:
        holder["on"] = step in spikes

    def spike(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * 100 if holder["on"] else None

    def session(model: torch.nn.Module) -> Any:
        model.model.layers[1].mlp.register_forward_hook(spike)
        return _monitor(out, **{"trace_steps": 1, **options})(model)

    return session, around


def test_an_inf_at_step_3_traces_the_next_n_steps_and_only_those(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="probe.monitor"):
        _train(9, _monitor(tmp_path / "r", trace_steps=2), plant=(3, _plant_inf))
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == [4, 5]
    for step in run.steps:
        traced = step in (4, 5)
        assert (layout.step_dir(tmp_path / "r", 0, step) / STATS_FILE).exists() == traced
        assert bool(run.monitor(step, 0))  # every step keeps its monitor data
        marker = run.step_info(step, 0).manifest.get("escalated")
        assert (marker is not None) == traced
    ops = run.ops(4, 0)
    assert all(t.stats is not None for op in ops for t in op.outputs if t.floating and t.skipped is None)
    marker = run.step_info(4, 0).manifest["escalated"]
    assert marker["window"] == [4, 5] and marker["trace_modes"] == ["stats"]
    assert [i["step"] for i in marker["incidents"]] == [3] and marker["incidents"][0]["rule"] == "nonfinite"
    bad = run.first_nonfinite(step=4, rank=0)
    assert bad is not None and bad.module.startswith("model.layers.1.mlp")
    assert "traced step 4 (1 of 2) with ['stats'] after the incident at step 3" in caplog.text
    assert "traced step 5 (2 of 2) with ['stats'] after the incident at step 3" in caplog.text

    [link] = escalation_links(run)
    assert link.root.step == 3 and link.traced == [4, 5] and link.recurred
    assert link.first_nonfinite is not None and link.nonfinite_step == 4
    text = link.describe()
    assert text.startswith("anomaly at step 3 rank 0 (nonfinite: ") and "traced steps 4-5: recurred" in text
    assert f"first non-finite {link.first_nonfinite.name} at model.layers.1.mlp" in text
    assert "parameters non-finite at the step's start: 1 (model.layers.1.mlp.up_proj.weight)" in text


def test_each_traced_step_is_announced_as_it_runs_and_no_step_the_run_never_reached(tmp_path, caplog):
    # Steps 0-4; the inf at step 3 opens the window 4-5, and the run ends after step 4.
    with caplog.at_level(logging.WARNING, logger="probe.monitor"):
        _train(5, _monitor(tmp_path / "r", trace_steps=2), plant=(3, _plant_inf))
    assert _traced_steps(probe.load(tmp_path / "r")) == [4]
    assert "traced step 4 (1 of 2) with ['stats'] after the incident at step 3" in caplog.text
    assert "step 5" not in caplog.text


def test_the_summary_links_a_spike_to_the_module_that_made_it(tmp_path):
    # After the monitor's 5 warm-up steps: up_proj's weight x1e4 lifts layer 1's output.
    _train(10, _monitor(tmp_path / "r", trace_steps=3), plant=(6, _plant_spike))
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == [7, 8, 9]
    [link] = escalation_links(run)
    assert link.root.step == 6 and link.root.rule == "turbulence" and link.root.module == "model.layers.1"
    assert link.recurred and link.first_nonfinite is None
    top = link.jumps[0]
    assert top.module == "model.layers.1.mlp.up_proj" and top.ratio > 100
    from probe.cli import main

    assert main(["summary", str(tmp_path / "r")]) == 0


def test_a_spike_that_does_not_recur_is_said_so(tmp_path):
    session, around = _spiking_session(tmp_path / "r", (6,), trace_steps=2)
    _train(10, session, around=around)
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == [7, 8]
    [link] = escalation_links(run)
    assert link.root.step == 6 and link.recurred is False and len(link.values) == 2
    assert "did not recur in traced steps 7-8" in link.describe()


def test_untriggered_escalation_installs_nothing_and_records_no_op(tmp_path):
    hooks_before = len(torch.nn.modules.module._global_forward_hooks)
    seen_hooks = []

    def around(step: int) -> None:
        seen_hooks.append(len(torch.nn.modules.module._global_forward_hooks))

    seen = _train(8, _monitor(tmp_path / "r", trace_modes=["stats", "dump"]), around=around)
    assert seen == [""] * 8  # no dispatch mode on the stack in any step
    assert seen_hooks == [hooks_before] * 8  # no module-tracker hooks
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == [] and run.anomalies() == []
    assert all("escalated" not in run.step_info(s, 0).manifest for s in run.steps)
    assert escalation_links(run) == []


def test_stats_and_dump_armed_together_write_both(tmp_path):
    _train(7, _monitor(tmp_path / "r", trace_modes=["stats", "dump"], trace_steps=1,
                       trace_options={"tensors": "outputs"}), plant=(3, _plant_inf))
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == [4]
    assert run.has_dump(step=4, rank=0) and not run.has_dump(step=5, rank=0)
    entries = run.dump(step=4, rank=0).entries
    assert entries and {io for _, io, _ in entries} == {"output"}  # trace_options reached the dump mode


def test_with_the_writer_thread_tracing_starts_once_the_numbers_are_on_the_host(tmp_path):
    _train(9, _monitor(tmp_path / "r", trace_steps=2, async_flush=True), plant=(3, _plant_inf))
    run = probe.load(tmp_path / "r")
    traced = _traced_steps(run)
    # Step 3's numbers reach the host on the writer thread while step 4 runs: 4-5 if in time, else 5-6.
    assert traced in ([4, 5], [5, 6])
    [link] = escalation_links(run)
    assert link.traced == traced and link.recurred


def _ops_and_flops(steps: int, session: Any, enter_at: int, leave_at: int, mode: Callable[[], Any]
                   ) -> tuple[Any, list[str]]:
    """A user dispatch mode entered at the start of step ``enter_at`` and left at that of ``leave_at``."""
    held: dict[str, Any] = {}

    def around(step: int) -> None:
        if step == enter_at:
            held["mode"] = mode()
            held["mode"].__enter__()
        if step == leave_at:
            held["mode"].__exit__(None, None, None)

    seen = _train(steps, session, plant=(3, _plant_inf), around=around)
    return held["mode"], seen


@pytest.mark.parametrize("enter_at, leave_at", [(1, 8), (5, 7)], ids=["before-the-window", "inside-it"])
def test_a_flop_counter_held_across_the_window_counts_every_step(tmp_path, enter_at, leave_at):
    def counter() -> FlopCounterMode:
        return FlopCounterMode(display=False)

    base, _ = _ops_and_flops(9, None, enter_at, leave_at, counter)
    held, seen = _ops_and_flops(9, _monitor(tmp_path / "r"), enter_at, leave_at, counter)
    assert held.get_total_flops() == base.get_total_flops() > 0
    assert _traced_steps(probe.load(tmp_path / "r")) == [4, 5]
    assert "ProbeDispatchMode" in seen[4] and "ProbeDispatchMode" not in seen[6]
    assert not any(isinstance(m, ProbeDispatchMode) for m in _get_current_dispatch_mode_stack())


@pytest.mark.slow
@pytest.mark.parametrize("enter_at, leave_at", [(1, 8), (5, 7)], ids=["before-the-window", "inside-it"])
def test_a_debug_mode_held_across_the_window_logs_the_same_ops(tmp_path, enter_at, leave_at):
    from torch.utils._debug_mode import DebugMode

    def names(mode: Any) -> list[str]:
        return [str(getattr(call, "op", call)) for call in mode.operators]

    # The same ops as without the probe: its statistics and step-end work are invisible to the mode.
    base, _ = _ops_and_flops(9, None, enter_at, leave_at, DebugMode)
    held, seen = _ops_and_flops(9, _monitor(tmp_path / "r"), enter_at, leave_at, DebugMode)
    assert names(held) == names(base) and len(names(base)) > 100
    # The user's mode stays on top: it sees the model's ops first, never the probe's statistics.
    assert seen[5].split(",")[0] == "ProbeDispatchMode" and seen[5].endswith("DebugMode")
    assert _traced_steps(probe.load(tmp_path / "r")) == [4, 5]


@pytest.mark.parametrize(("options", "message"), [
    ({"on_anomaly": "warn"}, "'warn' is not one of ['log', 'dump', 'stop', 'trace']"),
    ({"trace_modes": ["stats", "upcast"]}, "unknown trace mode(s) ['upcast']"),
    ({"trace_modes": []}, "trace_modes"),
    ({"trace_steps": 0}, "option 'trace_steps': expected an int >= 1, got 0"),
    ({"trace_steps": 2, "on_anomaly": "log"}, "'trace_steps' arms per-op tracing after an anomaly, which "
                                              "needs on_anomaly='trace'; on_anomaly is 'log'"),
    ({"trace_options": {"tensor": "all"}}, "['tensor'] is not an option of the trace modes ['stats']"),
    ({"trace_modes": ["dump"], "trace_options": {"tensors": "some"}}, "'some'"),
    ({"trace_options": ["inputs"]}, "'trace_options': expected a dict"),
    ({"trace_limit": 0}, "option 'trace_limit': expected an int >= 1, got 0"),
    ({"trace_limit": 2, "on_anomaly": "log"}, "'trace_limit' arms per-op tracing after an anomaly"),
])
def test_bad_escalation_options_name_the_value(tmp_path, options, message):
    options = {"on_anomaly": "trace", **options}
    with pytest.raises(ProbeError) as raised:
        probe.mode("monitor", out=tmp_path / "r", model=tiny_llama(), targets=LAYERS, **options)
    assert message in str(raised.value)


def test_escalation_beside_an_always_on_per_op_mode_is_refused(tmp_path):
    with pytest.raises(ProbeError, match=r"traces every op already with \['stats'\]"):
        probe.mode(["monitor", "stats"], out=tmp_path / "r", model=tiny_llama(), targets=LAYERS,
                   on_anomaly="trace")


def test_a_config_file_arms_escalation(tmp_path):
    config = tmp_path / "monitor.json"
    config.write_text(json.dumps({"targets": {"model.layers.?": {"output": "tensor"}}, "on_anomaly": "trace",
                                  "trace_modes": ["stats"], "trace_steps": 1}))
    _train(6, lambda model: probe.mode(config=config, out=tmp_path / "r", model=model, async_flush=False),
           plant=(3, _plant_inf))
    assert _traced_steps(probe.load(tmp_path / "r")) == [4]


def test_a_step_that_raises_inside_the_window_is_kept_and_the_tracer_taken_off(tmp_path):
    def around(step: int) -> None:
        if step == 5:
            raise RuntimeError("training broke")

    with pytest.raises(RuntimeError, match="training broke"):
        _train(9, _monitor(tmp_path / "r", trace_steps=3), plant=(3, _plant_inf), around=around)
    assert _get_current_dispatch_mode_stack() == []
    run = probe.load(tmp_path / "r")
    info = run.step_info(5, 0)
    assert not info.complete and info.manifest["escalated"]["window"] == [4, 6]
    assert _traced_steps(run) == [4]  # step 5 broke off before its first op


def test_an_incident_at_the_last_step_is_said_not_traced(tmp_path):
    _train(5, _monitor(tmp_path / "r"), plant=(4, _plant_inf))
    run = probe.load(tmp_path / "r")
    assert _traced_steps(run) == []
    [link] = escalation_links(run)
    assert link.traced == [] and link.recurred is None
    assert link.describe().endswith("-> not traced: the run ended before the step after it was known")


@pytest.mark.parametrize("limit", [1, None])
def test_the_trace_limit_bounds_the_windows_and_the_summary_says_why(tmp_path, caplog, limit):
    session, around = _spiking_session(tmp_path / "r", (6, 9), trace_limit=limit)
    with caplog.at_level(logging.WARNING, logger="probe.monitor"):
        _train(12, session, around=around)
    run = probe.load(tmp_path / "r")
    first, second = escalation_links(run)
    assert (first.root.step, first.traced) == (6, [7])
    if limit is None:
        assert _traced_steps(run) == [7, 10] and second.traced == [10]
        assert "trace_limit" not in caplog.text
        return
    assert _traced_steps(run) == [7]
    assert second.root.step == 9 and second.traced == [] and second.recurred is None
    assert second.describe().endswith("-> not traced: the session had traced 1 window(s), its trace_limit")
    assert run.step_info(10, 0).manifest["escalation_refused"]["trace_limit"] == 1
    assert "not tracing after the incident at step 9: this session traced 1 window(s)" in caplog.text


def test_the_window_freezes_the_heap_while_it_traces_and_only_then(tmp_path):
    import gc

    frozen: list[bool] = []
    seen = _train(8, _monitor(tmp_path / "r", trace_steps=2), plant=(3, _plant_inf),
                  around=lambda step: frozen.append(gc.get_freeze_count() > 0))
    traced = [step for step, modes in enumerate(seen) if "ProbeDispatchMode" in modes]
    assert traced == [4, 5]
    assert [step for step, f in enumerate(frozen) if f] == traced  # see probe.tracer.frozen_heap
    assert gc.get_freeze_count() == 0
