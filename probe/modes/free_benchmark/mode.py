"""Mode "free_benchmark": re-run each selected op perturbed and see whether it is fragile.

Without a reference run: each selected op is run a second time with a small
perturbation (``perturbations``) and its output compared with the original one.
An op whose output keeps fewer than ``MIN_BITS`` significant bits given its
inputs' rounding (the bits rule: a cancellation), or whose result differs from a
higher-precision or CPU one by more than rounding (the rounding rule: a kernel
that computes badly), is reported as ``fail``; ``improve_precision`` (the
default) re-runs twice to apply both rules. With ``handler="check"`` the original
output always flows on, so training is bit-identical to a run without the probe;
with ``handler="fix"`` the output is replaced by the higher-precision
(``improve_precision``) or CPU (``to_cpu``) result, cast back into the original
tensor (dtype, shape, strides and in-place semantics kept).

Safety: arguments the schema marks as written are copied before the real op
runs, and the perturbed run works on copies; factory ops, views, random ops,
collectives, host syncs and pure data movement are never re-run; running out
of memory during a check skips that check, with a record. Deviations are
computed on the device, many pairs per reduction (``probe.modes.free_benchmark.deviation``), and
read with the step's results, without host syncs (except ``to_cpu`` on a device,
which copies to the CPU by definition).

Preheat (``preheat=True``): for the first ``preheat_steps`` steps at most
``max_sample`` calls per op are measured and not judged; afterwards an op's
bound under each rule is the larger of the default and twice the largest deviation that
rule measured for it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from probe.modes.base import Mode
from probe.modes.free_benchmark.cpu_reference import cpu_reference
from probe.modes.free_benchmark.deviation import DeviationQueue
from probe.modes.free_benchmark.files import CHECKS_FILE, ChecksFiles
from probe.modes.free_benchmark.options import FreeBenchmark
from probe.modes.free_benchmark.perturbations import (
    BITS_BOUND,
    JUDGES_BITS,
    MIN_BITS,
    Perturbation,
    bits_kept,
    higher_precision,
    one_ulp_moved,
    reduction_length,
    rounding_scale,
    significant_bits,
    threshold,
)
from probe.modes.registry import register_mode
from probe.modes.rerunnable import eligible
from probe.rundir.writer import StepWriter
from probe.tracer.dispatch_mode import dtype_name
from probe.tracer.op_call import OpCall
from probe.vocabulary.op_tensors import map_arguments, results_of

PASS, FAIL, SKIP = "pass", "fail", "skip"


# Outputs defined only up to sign or phase (eigenvectors, singular vectors, QR factors): a
# perturbed run may legitimately flip them, which no bound on rounding tells from fragility.
# Op short name -> positions of such outputs; the others (eigenvalues, singular values) are checked.
_UP_TO_SIGN: dict[str, tuple[int, ...]] = {
    "linalg_eigh": (1,), "_linalg_eigh": (1,), "linalg_eig": (1,), "_linalg_eig": (1,),
    "linalg_svd": (0, 2), "_linalg_svd": (0, 2), "svd": (0, 2),
    "linalg_qr": (0, 1), "qr": (0, 1), "geqrf": (0, 1),
}


@register_mode
class FreeBenchmarkMode(Mode):
    """Perturb-and-compare checks (and fixes) of selected ops."""

    name = "free_benchmark"
    config_class = FreeBenchmark
    files = ChecksFiles

    def __init__(self, config: FreeBenchmark) -> None:
        super().__init__(config)
        self.perturbation = Perturbation(config.perturb)
        self.handler = config.handler
        self.preheat = config.preheat
        self.preheat_steps = config.preheat_steps
        self.max_sample = config.max_sample
        self.max_checks_per_op = config.max_checks_per_op
        self._step = 0
        # Preheat: per (rule, op name), the largest deviation seen (the writer thread keeps it).
        self._preheat_max: dict[tuple[str, str], float] = defaultdict(float)
        self._reset()

    def _reset(self) -> None:
        self._snapshots: dict[int, dict[int, torch.Tensor]] = {}
        self._counts: dict[str, int] = defaultdict(int)
        self._pending: list[dict[str, Any]] = []
        self._deviations = DeviationQueue()

    def begin_step(self, step: int) -> None:
        self._step = step
        self._reset()

    def _limit(self) -> int | None:
        if self.preheat and self._step < self.preheat_steps:
            return self.max_sample
        return self.max_checks_per_op

    # -- per op -----------------------------------------------------------------

    def before(self, call: OpCall) -> None:
        info = call.info
        if not eligible(info) or not any(t.is_floating_point() for t in call.input_tensors or ()):
            return
        limit = self._limit()
        if limit is not None and self._counts[info.name] >= limit:
            return
        self._counts[info.name] += 1
        # Written arguments change when the op runs: the perturbed run needs them as they were.
        self._snapshots[call.index] = {
            id(t): t.detach().clone() for t in call.written()
        }

    def after(self, call: OpCall) -> None:
        snapshot = self._snapshots.pop(call.index, None)
        if snapshot is None:
            return
        if call.skipped:  # a tensor the tracer could not key (see OpCall.skipped)
            io, position, reason = call.skipped[0]
            self._skip(call, f"{io}put {position} is a {reason} tensor: not checked")
            return
        name = self.perturbation.name
        originals = list(call.output_tensors or ())
        try:
            rerun, delta, inputs = self._rerun(call, snapshot)
            # improve_precision measures the op's own rounding against its higher-precision
            # result, and its inputs' rounding by a second run with every input moved one ULP.
            higher = self.perturbation.in_higher_precision
            nudged, bits_delta = self._rerun(call, snapshot, nudge=True)[:2] if higher else (None, 0.0)
        except torch.OutOfMemoryError:
            self._skip(call, "out of memory during the check")
            return
        except Exception as e:  # whatever the re-run raises (ValueError: _scaled_mm), training goes on
            self._skip(call, f"{type(e).__name__}: {str(e)[:200]}")
            return
        for results in (rerun, nudged):
            if results is not None and len(results) != len(originals):
                self._skip(call, f"the re-run gave {len(results)} results, the op {len(originals)}")
                return
        # Which pairs each rule compares: (reference, re-run) per output.
        with_originals = list(zip(originals, rerun, strict=True))
        if nudged is not None:
            rounding_pairs, bits_pairs = with_originals, list(zip(rerun, nudged, strict=True))
        elif name in JUDGES_BITS:
            rounding_pairs, bits_pairs = [], with_originals
            bits_delta, delta = delta, 0.0
        else:
            rounding_pairs, bits_pairs = with_originals, []
        floor = rounding_scale(inputs) if any(o.numel() for o in originals) else None
        up_to_sign = _UP_TO_SIGN.get(call.info.short, ())
        for position, (original, perturbed) in enumerate(zip(originals, rerun, strict=True)):
            if not (original.is_floating_point() and perturbed.is_floating_point()):
                continue
            if position in up_to_sign and original.numel():
                self._skip(call, "defined only up to sign or phase: a perturbed run may flip it",
                           position)
                continue
            if original.shape != perturbed.shape:
                continue
            rows = {
                rule: self._measure(pairs[position], original.dtype, floor) if pairs and original.numel()
                else -1
                for rule, pairs in (("rounding", rounding_pairs), ("bits", bits_pairs))
            }
            self._pending.append({
                "op": call.index, "op_id": call.op_id, "name": call.info.name, "module": call.module,
                "phase": call.phase, "output": position, "dtype": dtype_name(original.dtype),
                "shape": list(original.shape), "rows": rows, "delta": delta, "bits_delta": bits_delta,
                "reduction": reduction_length(call.info.name, call.args, position),
                "measured": [rule for rule, pairs in (("rounding", rounding_pairs), ("bits", bits_pairs))
                             if pairs],
            })
            if self.handler == "fix":
                with torch.no_grad():
                    original.copy_(perturbed.to(original.device))

    def _measure(self, pair: tuple[torch.Tensor, torch.Tensor], out_dtype: torch.dtype,
                 floor: torch.Tensor | None) -> int:
        """Queue the deviation of ``pair[1]`` from ``pair[0]``; its row in the step's results.

        Queued pairs are copied (small ones) or reduced at once (large ones): an in-place
        write to the original output after this op cannot change what is measured.
        """
        return self._deviations.add(pair[0], pair[1], out_dtype, floor)

    def _skip(self, call: OpCall, reason: str, output: int | None = None) -> None:
        self._pending.append({
            "op": call.index, "op_id": call.op_id, "name": call.info.name, "module": call.module,
            "phase": call.phase, "output": output, "dtype": None, "shape": None, "skip": reason,
        })

    def _rerun(self, call: OpCall, snapshot: dict[int, torch.Tensor], nudge: bool = False,
               ) -> tuple[list[torch.Tensor], Any, list[torch.Tensor]]:
        """Run the op again on perturbed copies of its inputs.

        Returns its results, the relative input change, and the floating inputs as the op
        read them. ``nudge`` (improve_precision's second run): every floating input is
        moved one ULP in its own dtype before it is computed in the higher precision.
        """
        pert = self.perturbation
        target_device = torch.device("cpu") if pert.on_cpu else None
        deltas: list[Any] = []
        inputs: list[torch.Tensor] = []

        def convert(value: Any) -> Any:  # one argument; map_arguments walks the lists
            if isinstance(value, torch.Tensor):
                t = snapshot.get(id(value), value)
                if t.is_floating_point():
                    inputs.append(t)
                    compute = higher_precision(t.dtype) if pert.in_higher_precision else None
                    if nudge:
                        deltas.append(torch.finfo(t.dtype).eps)
                        t = one_ulp_moved(t, compute)  # moved and upcast in one pass
                    elif compute is not None:
                        t = t.to(compute)
                    else:
                        t, delta = pert.perturb(t)
                        deltas.append(delta)
                elif id(value) in snapshot:
                    t = t.clone()
                else:
                    t = t.clone() if call.info.mutates else t
                return t.to(target_device) if target_device is not None else t
            if isinstance(value, torch.device) and target_device is not None:
                return target_device
            return value

        args = [map_arguments(a, convert) for a in call.args]
        kwargs = {k: map_arguments(v, convert) for k, v in (call.kwargs or {}).items()}
        func = call.func
        reference = cpu_reference(call.info.name) if target_device is not None else None
        out = (reference or func)(*args, **kwargs)
        results = results_of(call.info, args, kwargs, out)  # written copies included
        delta = max((d for d in deltas if isinstance(d, float)), default=0.0)
        tensor_deltas = [d for d in deltas if isinstance(d, torch.Tensor)]
        if tensor_deltas:
            delta = torch.stack([*tensor_deltas]).max().clamp(min=delta)
        return results, delta, inputs

    # -- step end -------------------------------------------------------------------

    def end_step(self, step: int) -> ChecksStep:
        self._deviations.finish()  # reduce what is staged, on the training stream, and free the buffers
        result = ChecksStep(step, self._pending, self._deviations, self.perturbation.name, self.handler,
                            self.preheat and step < self.preheat_steps,
                            self._preheat_max if self.preheat else None)
        self._reset()
        return result


# What the rounding rule compares each perturbation's run with, for the reasons of failed checks.
_ROUNDING_REFERENCE = {"improve_precision": "the higher-precision result", "to_cpu": "the CPU result",
                       "no_change": "a re-run", "change_value": "the run with swapped inputs"}


def _fail_reason(rule: str, ratio: float, bound: float, mismatch: int, perturb: str,
                 dtype: torch.dtype) -> str:
    if mismatch:
        return f"rule {rule}: {mismatch} elements became or stopped being NaN/Inf"
    if rule == "bits":
        return (f"rule bits: keeps {bits_kept(ratio, dtype):.1f} of {significant_bits(dtype)} significant "
                f"bits given its inputs' rounding (relative change {ratio:.3g} > {bound:.3g}; "
                f"fewer than {MIN_BITS} bits fail)")
    return (f"rule rounding: differs from {_ROUNDING_REFERENCE.get(perturb, 'the re-run')} by {ratio:.3g} "
            f"relative, more than its rounding allows ({bound:.3g})")


class ChecksStep:
    """One step's checks: deviations still on their devices until written.

    ``preheat_max`` (with preheat): each (rule, op)'s largest deviation while preheating,
    kept across steps by the writes alone (one step at a time, in order), never by the mode.
    """

    def __init__(self, step: int, pending: list[dict[str, Any]], deviations: DeviationQueue,
                 perturb: str, handler: str, preheating: bool,
                 preheat_max: dict[tuple[str, str], float] | None) -> None:
        self.step, self.pending, self.deviations = step, pending, deviations
        self.perturb, self.handler = perturb, handler
        self.preheating, self.preheat_max = preheating, preheat_max

    def write(self, writer: StepWriter) -> dict[str, Any]:
        values = self.deviations.values()
        counts = {PASS: 0, FAIL: 0, SKIP: 0}
        records = []
        for entry in self.pending:
            record = {k: v for k, v in entry.items()
                      if k not in ("rows", "delta", "bits_delta", "measured", "skip")}
            record["perturb"] = self.perturb
            if "skip" in entry:
                record.update(verdict=SKIP, reason=entry["skip"])
            else:
                self._judge(entry, record, values)
            counts[record["verdict"]] += 1
            records.append(record)
        writer.write_jsonl(CHECKS_FILE, records)
        return {"checks": len(records), **counts, "perturb": self.perturb, "handler": self.handler}

    def _judge(self, entry: dict[str, Any], record: dict[str, Any], values: np.ndarray) -> None:
        """The verdict of one check under each rule it measured; the record shows the deciding one."""
        preheating, preheat_max = self.preheating, self.preheat_max
        delta = entry["delta"]
        delta = float(delta) if not isinstance(delta, torch.Tensor) else float(delta.cpu())
        dtype = getattr(torch, entry["dtype"])
        judged: dict[str, tuple[float, float, int, int]] = {}
        for rule in entry["measured"]:
            row = entry["rows"][rule]
            ratio, mismatch, flips = values[row] if row >= 0 else (0.0, 0, 0)
            bound = threshold(delta, dtype, entry["reduction"]) if rule == "rounding" else BITS_BOUND
            if preheat_max is not None and not preheating:
                bound = max(bound, 2 * preheat_max.get((rule, entry["name"]), 0.0))
            judged[rule] = (float(ratio), bound, int(mismatch), int(flips))

        def excess(rule: str) -> float:
            ratio, bound, mismatch, _ = judged[rule]
            return math.inf if mismatch or not ratio <= bound else ratio / bound

        deciding = max(judged, key=excess)
        ratio, bound, mismatch, flips = judged[deciding]
        record.update(ratio=ratio, threshold=bound, input_change=max(delta, float(entry["bits_delta"])),
                      nonfinite_mismatch=max(j[2] for j in judged.values()),
                      sign_flips=max(j[3] for j in judged.values()), rule=deciding)
        if "bits" in judged:
            record["bits_kept"] = bits_kept(judged["bits"][0], dtype)
        if preheating and preheat_max is not None:
            for rule, (rule_ratio, *_) in judged.items():
                key = (rule, entry["name"])
                preheat_max[key] = max(preheat_max.get(key, 0.0), rule_ratio)
            record.update(verdict=SKIP, reason="preheat")
        elif excess(deciding) > 1:
            reason = _fail_reason(deciding, ratio, bound, mismatch, self.perturb, dtype)
            record.update(verdict=FAIL, reason=reason)
        else:
            record["verdict"] = PASS
