"""PyTorch's own operator database (OpInfo ``op_db``) under the probe: transparency and statistics.

Every operator, one sample, one dtype (float32, or the OpInfo's first complex/other dtype where
float32 is not supported), with autograd where the OpInfo supports it, is run once bare and once
under each of ``stats``, ``dump`` and ``free_benchmark`` (one session per mode and shard, one step
per operator). Asserted for every case:

- nothing raises that did not raise bare;
- outputs and gradients are bit-identical to the bare run, and the RNG state after it is the same;
- outputs and gradients have the bare run's strides and storage offsets. Gradients are read from
  ``.grad`` after ``backward``: autograd's AccumulateGrad keeps a gradient as computed only when
  nothing else holds a reference to it, and copies it into the leaf's layout otherwise, so a mode
  that keeps an op's tensors alive past the op shows here (the free benchmark did, through a
  reference cycle: ``linalg.solve``'s gradients came back with other strides, values equal);
- under ``stats``, the statistics recorded for the op that produced each output equal a fp64
  recomputation of the real output (its producer is found through the graph: the output is read
  by one ``aten.alias``, whose input source names the producing record).

Not asserted: what any TorchDispatchMode changes. While a mode is active, ATen's
``isTensorSubclassLike`` is true for every tensor, so some composite kernels and autograd formulas
(``prod``'s backward, linalg norms, ``cond``, ``eigvalsh``, ``svdvals``) take their subclass-safe
path and may round differently; the probe cannot avoid that while it traces. With the one sample
per op used here no op's values are affected (torch 2.13); should one be, compare it with a run under
a bare passthrough ``TorchDispatchMode`` and say so here. Layouts are: ``ormqr``'s gradient comes
back with other strides under any dispatch mode, so a layout that differs from the bare run's is
accepted when a run under a bare passthrough mode gives the probed one.

Free-benchmark *verdicts* are not asserted (a ``fail`` is a finding, not a fault).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from probe.rundir import layout
from probe.rundir.op_record_fields import RECORD_FIELD_INDEX
from probe.rundir.op_record_json import decode

common_methods_invocations = pytest.importorskip(
    "torch.testing._internal.common_methods_invocations",
    reason="OpInfo needs torch's test dependencies (expecttest)",
)
op_db = common_methods_invocations.op_db

# OpInfo samples call deprecated functions (upsample_*, torch.lu, stft without a window).
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SHARDS = 4
MODES = ("stats", "dump", "free_benchmark")

# Their outputs are memory nothing wrote: only dtype, shape and layout are defined.
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}
)


def _dtype_of(op) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    if torch.float32 in supported:
        return torch.float32
    for dtype in (torch.complex64, torch.float64, torch.int64, torch.int32, torch.bool, torch.uint8):
        if dtype in supported:
            return dtype
    return next(iter(supported), None)


def _case_name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


CASES = [op for op in op_db if _dtype_of(op) is not None]


@dataclass
class Outcome:
    """What one operator did: its outputs, gradients, RNG state after, or the error it raised."""

    error: str | None = None
    outputs: list[Any] = field(default_factory=list)
    grads: list[Any] = field(default_factory=list)
    rng: torch.Tensor | None = None
    # Strides and storage offset of each output, then of each gradient, as returned (a clone
    # need not keep them).
    layouts: list[Any] = field(default_factory=list)


class _Passthrough(TorchDispatchMode):
    """A dispatch mode that only runs each op: what any mode changes, the probe's or not."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _layout(t: torch.Tensor | None) -> tuple[tuple[int, ...], int] | None:
    if t is None or t.layout != torch.strided or t.is_nested:
        return None
    return tuple(t.stride()), t.storage_offset()


def _sample(op):
    """The op's first sample (made afresh each time: runs must not share input tensors)."""
    dtype = _dtype_of(op)
    torch.manual_seed(1234)
    grad = op.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
    sample = next(iter(op.sample_inputs("cpu", dtype, requires_grad=grad)), None)
    return sample, grad


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _run(op, sample_and_grad, session=None, alias_outputs: bool = False,
         dispatch_mode: TorchDispatchMode | None = None) -> Outcome:
    """Run ``op`` on its sample (forward, then backward into ``.grad`` where supported), under
    ``dispatch_mode`` if given; ``session.step()`` ends the step. ``alias_outputs`` reads each
    output through one ``aten.alias`` (see module doc)."""
    sample, grad = sample_and_grad
    if sample is None:
        if session is not None:
            session.step()
        return Outcome(error="no sample")
    outcome = Outcome()
    torch.manual_seed(99)
    try:
        with dispatch_mode if dispatch_mode is not None else contextlib.nullcontext():
            _forward_backward(op, sample, grad, alias_outputs, outcome)
    except Exception as e:  # the bare run defines which errors are the op's own
        outcome.error = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        if session is not None:
            session.step()
    outcome.rng = torch.get_rng_state()
    return outcome


def _forward_backward(op, sample, grad: bool, alias_outputs: bool, outcome: Outcome) -> None:
    """The op on its sample, then backward into ``.grad``; what it gives goes into ``outcome``."""
    out = op(sample.input, *sample.args, **sample.kwargs)
    outputs = _tensors(out)
    if alias_outputs:
        for t in outputs:
            if t.layout == torch.strided and not t.is_nested:
                torch.ops.aten.alias.default(t)
    outcome.outputs = [t.detach().clone() if t.layout == torch.strided and not t.is_nested else t.detach()
                       for t in outputs]
    outcome.layouts = [_layout(t) for t in outputs]
    if grad:
        inputs = [t for t in _tensors([sample.input, sample.args, list(sample.kwargs.values())])
                  if t.requires_grad]
        differentiable = [t for t in outputs if t.requires_grad and t.grad_fn is not None]
        if inputs and differentiable:
            # Into .grad, as training does: the leaves' AccumulateGrad decides their layout.
            torch.autograd.backward(
                differentiable, [torch.ones_like(t) for t in differentiable], inputs=inputs
            )
            grads = [t.grad for t in inputs]
            outcome.grads = [None if g is None else g.detach().clone() for g in grads]
            outcome.layouts += [_layout(g) for g in grads]


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if a.layout != b.layout or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout != torch.strided or a.is_nested:
        try:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
        return True
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    return torch.equal(  # bit for bit (-0.0 is not 0.0, NaN payloads count)
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


def _same_metadata(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.layout == b.layout


def _differences(op, bare: Outcome, probed: Outcome) -> list[str]:
    if bare.error is not None:
        return []  # the op fails on its own: the probe only must not mask or change that into a crash
    if probed.error is not None:
        return [f"raised under the probe: {probed.error}"]
    found = []
    same = _same_metadata if op.name in UNINITIALIZED else _same
    if len(bare.outputs) != len(probed.outputs) or not all(map(same, bare.outputs, probed.outputs)):
        found.append("outputs differ")
    if len(bare.grads) != len(probed.grads) or not all(map(_same, bare.grads, probed.grads)):
        found.append("gradients differ")
    if not torch.equal(bare.rng, probed.rng):
        found.append("RNG state differs")
    # A layout any dispatch mode gives is not the probe's doing (see module doc).
    if not found and bare.layouts != probed.layouts \
            and _run(op, _sample(op), dispatch_mode=_Passthrough()).layouts != probed.layouts:
        found.append(f"strides or storage offsets differ: {bare.layouts} bare, {probed.layouts} probed")
    return found


def _shard(index: int) -> list:
    return CASES[index::SHARDS]


_BARE: dict[str, Outcome] = {}


def _bare_outcome(op) -> Outcome:
    name = _case_name(op)
    if name not in _BARE:
        _BARE[name] = _run(op, _sample(op))
    return _BARE[name]


def _fp64_stats(t: torch.Tensor) -> dict[str, float]:
    t = t.detach().resolve_conj().resolve_neg()
    x = (torch.view_as_real(t) if t.is_complex() else t).to(torch.float64)
    finite = x[torch.isfinite(x)]
    return {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(),
            "norm": torch.linalg.vector_norm(x).item(), "nan": int(x.isnan().sum()),
            "inf": int(x.isinf().sum()), "scale": finite.abs().max().item() if finite.numel() else 1.0}


def _stats_mismatch(recorded: dict, real: torch.Tensor) -> str | None:
    if real.numel() == 0 or real.dtype == torch.bool or not (real.is_floating_point() or real.is_complex()):
        return None
    ref = _fp64_stats(real)
    if (recorded["nan"], recorded["inf"]) != (ref["nan"], ref["inf"]):
        return f"nan/inf {recorded['nan'], recorded['inf']} != {ref['nan'], ref['inf']}"
    for key in ("min", "max"):
        same = recorded[key] == ref[key] or (math.isnan(recorded[key]) and math.isnan(ref[key]))
        if not same:
            return f"{key} {recorded[key]} != {ref[key]}"
    tol = 1e-9 * max(ref["scale"], 1e-30)
    both_nan = math.isnan(recorded["mean"]) and math.isnan(ref["mean"])
    if not (abs(recorded["mean"] - ref["mean"]) <= tol or both_nan):
        return f"mean {recorded['mean']} != {ref['mean']}"
    if recorded["norm"] != pytest.approx(ref["norm"], rel=1e-9, nan_ok=True):
        return f"norm {recorded['norm']} != {ref['norm']}"
    return None


def _check_stats(run, step: int, outcome: Outcome, checked: list[str]) -> list[str]:
    """The recorded statistics of each output's producer equal the real output's; the ids of
    the records checked are appended to ``checked``."""
    ops = run.ops(step)
    raw = (layout.step_dir(run.path, 0, step) / layout.OPS_FILE).read_text().splitlines()
    aliases = [decode(json.loads(line)) for line in raw if '"aten.alias.default"' in line]
    strided = [t for t in outcome.outputs if t.layout == torch.strided and not t.is_nested]
    found = []
    for alias, real in zip(aliases[-len(strided):] if strided else [], strided, strict=False):
        source = alias[RECORD_FIELD_INDEX["inputs"]][0][2]
        if source is None or not source[2]:
            continue  # not exactly a traced op's output (an input returned as is, a view of one)
        producer = ops[source[0]].outputs[source[1]]
        if producer.stats is None:
            if producer.skipped is None and real.numel() and (real.is_floating_point() or real.is_complex()):
                found.append(f"no statistics for {ops[source[0]].id}")
            continue
        checked.append(ops[source[0]].id)
        problem = _stats_mismatch(producer.stats, real)
        if problem:
            found.append(f"{ops[source[0]].id}: {problem}")
    return found


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("mode", MODES)
def test_opinfo_ops_are_transparent_and_their_statistics_true(tmp_path, mode, shard):
    cases = _shard(shard)
    bare = [_bare_outcome(op) for op in cases]
    options = {"max_checks_per_op": 1} if mode == "free_benchmark" else {}
    problems: dict[str, list[str]] = {}
    checked: list[str] = []
    samples = [_sample(op) for op in cases]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with probe.mode(mode, out=tmp_path / "run", **options) as session:
            probed = [_run(op, sample, session, alias_outputs=mode == "stats")
                      for op, sample in zip(cases, samples, strict=True)]
    run = probe.load(tmp_path / "run") if mode == "stats" else None
    for step, (op, b, p) in enumerate(zip(cases, bare, probed, strict=True)):
        found = _differences(op, b, p)
        if run is not None and not found and p.error is None and step in run.steps \
                and op.name not in UNINITIALIZED:
            found += _check_stats(run, step, p, checked)
        if found:
            problems[_case_name(op)] = found
    assert not problems, problems
    if mode == "stats":  # the statistics check found the producers of most outputs
        assert len(checked) > len(cases) // 2, len(checked)
