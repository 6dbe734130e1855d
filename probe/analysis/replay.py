"""Re-executing dumped ops from their dumped inputs, to test one kernel at a time.

msprobe's API accuracy checker needs a GPU or NPU; this needs only the dump.
``replay`` runs one op again (the exact overload, with its recorded arguments)
on another device and/or in another precision and compares the result with the
dumped output, in the output dtype's ULPs; ``replay_step`` does it for every
dumped op of a step and ranks the ops by error at the tensor's scale
(``max_ulp_at_scale``, :mod:`probe.analysis.metrics`), so a faulty kernel stands out without a
second training run, and a healthy op whose outputs cancel to near zero does not.

A run is untrusted input, so a replay is untrusted execution: only pure tensor computations
run, within a memory budget checked before anything is allocated
(:mod:`probe.analysis.replay_confinement`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from probe.analysis.metrics import scaled_error, tensor_metrics
from probe.analysis.mode_records import StepDump
from probe.analysis.random_draws import draws
from probe.analysis.replay_confinement import ReplayRefused, check_footprint, checked_budget, refusal
from probe.devices import usable_device
from probe.errors import ProbeError
from probe.rundir.call_args import decode_args
from probe.rundir.run import OpRecord, Run
from probe.vocabulary.op_class import classify, resolve_op
from probe.vocabulary.op_tensors import results_of


@dataclass
class ReplayResult:
    op_id: str
    name: str
    max_abs_err: float
    max_rel_err: float
    cosine: float
    max_ulp: float
    max_ulp_at_scale: float
    """ULPs with elements below the output's rms counted at its scale: what ranks the ops."""
    scaled_err: float
    """The largest error over the output's rms (``max_abs_err / ref_rms``), worst output."""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    """Per compared output: its position and metrics."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prepare(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    t = t.clone().to(device)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t


def replay(
    run: Run | str, op_id: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    step: int | None = None, rank: int | None = None, memory_budget: int | None = None,
) -> dict[str, Any]:
    """Re-run ``op_id`` from its dumped inputs; metrics of the result against the dumped output.

    ``dtype`` (e.g. ``torch.float64``) computes in that precision: floating inputs
    are converted, and the result is compared with the dumped output in the
    output's own dtype's ULPs. A device this process cannot compute on is a ``ProbeError``
    naming it. An op the replay will not execute (not a pure tensor computation, or taking
    more than ``memory_budget`` bytes; default a quarter of physical memory) is a
    :class:`~probe.analysis.replay_confinement.ReplayRefused` (a ``ProbeError``) naming it
    and why, raised before anything is allocated.
    """
    checked = usable_device(device)
    budget = checked_budget(memory_budget)
    run = run if isinstance(run, Run) else Run(run)
    op = run.op(op_id, step, rank)
    return _replay(run, op, checked, dtype, budget).as_dict()


def recompute(run: Run, op: OpRecord, device: torch.device, dtype: torch.dtype | None,
              memory_budget: int | None = None) -> list[torch.Tensor]:
    """``op``'s results, computed again from its dumped inputs and recorded arguments.

    ``dtype`` converts the floating inputs first (``torch.float64``: the op's exact result
    on those inputs, as near as fp64 gets). Raises ``ProbeError`` for ops that draw random
    numbers or that are not in the dump, and ``ReplayRefused`` (a ``ProbeError``) for ops
    that are not pure tensor computations or that would take more than ``memory_budget``
    bytes (default: a quarter of physical memory), before anything is allocated.
    """
    budget = checked_budget(memory_budget)
    func = resolve_op(op.name)
    info = classify(func)
    if draws(op, bool(op.constants)):
        raise ProbeError(f"op {op.id} draws random numbers; its result cannot be reproduced")
    why = refusal(func)
    if why is not None:
        raise ReplayRefused(op, why)
    dump = run.dump(op.step, op.rank)
    call = dump.call(op.index)
    # Memory-mapped views of the dumped inputs: nothing is read or copied until they are prepared.
    dumped = [dump.tensor(op.index, "input", i) for i in range(len(op.inputs))]
    check_footprint(op, func, info, call, dumped, dtype, device.type != "cpu", budget)
    inputs = [_prepare(t, device, dtype) for t in dumped]
    args, kwargs = decode_args(call, inputs.__getitem__, device=device)
    out = func(*args, **kwargs)
    return list(results_of(info, args, kwargs, out))


def _replay(run: Run, op: OpRecord, device: torch.device, dtype: torch.dtype | None,
            budget: int) -> ReplayResult:
    results = recompute(run, op, device, dtype, budget)
    dump = run.dump(op.step, op.rank)
    compared = []
    for position, result in enumerate(results[: len(op.outputs)]):
        expected = dump.tensor(op.index, "output", position)
        if tuple(result.shape) != tuple(expected.shape):
            raise ProbeError(f"replay of {op.id} gave output {position} of shape {list(result.shape)}, "
                             f"the dump holds {list(expected.shape)}")
        # The replay is the reference (a), the dumped output the value under test
        # (b); errors are counted in ULPs of the less precise of the two dtypes.
        m = tensor_metrics(result.detach().to("cpu"), expected)
        compared.append({"position": position, **m.as_dict()})
    if not compared:
        raise ProbeError(f"op {op.id} has no output to compare")
    return ReplayResult(
        op_id=op.id, name=op.name,
        max_abs_err=max(c["max_abs_err"] for c in compared),
        max_rel_err=max(c["max_rel_err"] for c in compared),
        cosine=min(c["cosine"] for c in compared),
        max_ulp=max(c["max_ulp"] for c in compared),
        max_ulp_at_scale=max(c["max_ulp_at_scale"] for c in compared),
        scaled_err=max(_scaled(c) for c in compared),
        outputs=compared,
    )


def _scaled(compared: dict[str, Any]) -> float:
    value = scaled_error(compared["max_abs_err"], compared["ref_rms"])
    return math.inf if value is None else value


def replay_step(
    run: Run | str, step: int | None = None, rank: int | None = None, device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None, progress: Any = None, memory_budget: int | None = None,
) -> list[dict[str, Any]]:
    """Replay every op of a step whose inputs and outputs were dumped; worst first.

    Ops that cannot be replayed are listed last, each with ``"reason"`` (its kind:
    "not dumped", "random", "unknown op", "no output", "no dump", "refused", "failed") and
    ``"skipped"`` (the detail). "refused": the op is not a pure tensor computation, or replaying
    it would take more than ``memory_budget`` bytes (default: a quarter of physical memory), so
    it was not executed. A device this process cannot compute on is a ``ProbeError`` naming it,
    before any op is replayed.
    """
    checked = usable_device(device)
    budget = checked_budget(memory_budget)
    run = run if isinstance(run, Run) else Run(run)
    step, rank = run.resolve(step, rank)
    dump = run.dump(step, rank) if run.has_dump(step, rank) else None
    ranked, skipped = [], []
    for op in run.iter_ops(step, rank):  # a batch of records at a time, not the step's
        if progress is not None:
            progress()
        reason, detail = _why_not_replayable(dump, op)
        if reason is None:
            try:
                ranked.append(_replay(run, op, checked, dtype, budget).as_dict())
                continue
            except ReplayRefused as e:
                reason, detail = "refused", e.reason
            except _OP_FAILURES as e:
                reason, detail = "failed", f"{type(e).__name__}: {e}"
        skipped.append({"op_id": op.id, "name": op.name, "reason": reason, "skipped": detail})
    ranked.sort(key=lambda r: (-(r["max_ulp_at_scale"] if math.isfinite(r["max_ulp_at_scale"]) else math.inf),
                               r["op_id"]))
    return ranked + skipped


# What executing a recorded call can raise: its arguments come from an untrusted run, so any of
# these is that op's failure, listed with the others, never the end of the replay.
_OP_FAILURES = (ProbeError, RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError,
                NotImplementedError, OverflowError)


def _why_not_replayable(dump: StepDump | None, op: OpRecord) -> tuple[str | None, str]:
    """(reason, detail) when ``op`` cannot be replayed from the dump; (None, "") when it can."""
    if dump is None:
        return "no dump", "the step has no dump"
    if not op.outputs:
        return "no output", "the op returns no tensor"
    try:
        func = resolve_op(op.name)
    except ProbeError as e:  # its message names the op and what to import
        return "unknown op", str(e)
    if draws(op, bool(op.constants)):
        return "random", "it draws random numbers: its result cannot be reproduced"
    why = refusal(func)
    if why is not None:
        return "refused", why
    for io, records in (("input", op.inputs), ("output", op.outputs)):
        for position in range(len(records)):
            entry = dump.entries.get((op.index, io, position))
            if entry is None:
                return "not dumped", f"{io} {position} is not in the dump"
            if entry.status is not None:
                return "not dumped", f"{io} {position}: {entry.status}"
    return None, ""
