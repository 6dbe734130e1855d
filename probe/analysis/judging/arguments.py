"""An op called otherwise in the two runs: its scalar arguments, and the constants it reads."""

from __future__ import annotations

import math
from typing import Any

import torch

from probe.analysis.comparison_records import OpComparison
from probe.analysis.step_sides import Side
from probe.errors import ProbeError


def _scalar_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """The numbers and flags of a recorded call, by where they sit ("1", "alpha", "2.0"): what
    the call says beside its tensors. Dtypes, devices and layouts are left out, since
    precision policies change them and their rules judge them."""
    found: dict[str, Any] = {}

    def walk(where: str, value: Any) -> None:
        if isinstance(value, (bool, int, float)) or (isinstance(value, dict) and set(value) == {"float"}):
            found[where] = value
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{where}.{i}", v)

    for i, value in enumerate(call.get("args", [])):
        walk(str(i), value)
    for name, value in call.get("kwargs", {}).items():
        walk(name, value)
    return found

_DTYPE_LIMITS = tuple((name, d, float(getattr(torch.finfo(d), name)))
                      for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                      for name in ("max", "smallest_normal", "eps"))
"""``(limit, dtype, value)``: the numbers a program takes from a floating dtype's limits."""

def _limits_near(value: float | str) -> frozenset[tuple[str, torch.dtype]]:
    """The dtype limits ``value`` is within 2% of in magnitude (a floating dtype's largest value,
    smallest normal or eps): ``finfo(dtype).min`` as a mask's fill, T5's ``finfo(float16).max -
    1000`` as a clamp, ``nn.RMSNorm``'s default eps (its input dtype's)."""
    if type(value) is not float or not math.isfinite(value) or value == 0:
        return frozenset()
    return frozenset((name, d) for name, d, limit in _DTYPE_LIMITS if abs(abs(value) / limit - 1) <= 0.02)

def of_dtype_limits(va: float | str, vb: float | str) -> bool:
    """Whether two runs' numbers are one limit each run took from its own dtype: the same limit
    (largest value, smallest normal or eps) of two dtypes."""
    near_a, near_b = _limits_near(va), _limits_near(vb)
    return any(name == other and da != db for name, da in near_a for other, db in near_b)

def _argument_difference(where: str, va: Any, vb: Any) -> str:
    """One argument two calls were given otherwise, in words (both rules of *arguments*)."""
    return f"argument {where}: {va!r} in run A, {vb!r} in run B"

def constants_differ(c: OpComparison) -> str | None:
    """Why ``c`` was called with other constants in the two runs (None: it was not, or a run
    recorded none): an eps, a scale, a fill value or a mode word given to both runs' call of one
    op, different in each, is another computation at that op, whatever the precision of either
    run and however small its effect. A number each run derives from its own dtype's limits is
    not one (:func:`of_dtype_limits`); nor is a slot only one run filled with a number (the
    other passed a tensor there)."""
    assert c.a is not None and c.b is not None
    ka, kb = c.a.constants, c.b.constants
    if not ka or not kb or c.a.name != c.b.name:
        return None
    differing = []
    for where in sorted(set(ka) & set(kb)):
        va, vb = ka[where], kb[where]
        if va == vb or (va != va and vb != vb) or of_dtype_limits(va, vb):
            continue  # (NaN is a constant equal to itself)
        differing.append(_argument_difference(where, va, vb))
    if not differing:
        return None
    return f"called with other constants ({'; '.join(differing)})"

def called_otherwise(side_a: Side, side_b: Side, c: OpComparison) -> str | None:
    """Why ``c`` was called with other arguments on identical tensors (None: it was not).

    With every tensor input equal bit for bit (values, dtype, shape) in both runs, a result
    that differs can only come from what the call says beside its tensors: an eps, a scale,
    a dim. That is a change of the computation itself, at this op, however small its effect.
    """
    assert c.a is not None and c.b is not None
    if side_a.dump is None or side_b.dump is None or not c.a.inputs or len(c.a.inputs) != len(c.b.inputs):
        return None
    if [t.dtype for t in c.a.outputs] != [t.dtype for t in c.b.outputs]:
        return None  # a result in another dtype is called with that dtype's numbers (its finfo.min)
    for position in range(len(c.a.inputs)):
        data_a, _ = side_a.data(c.a, "input", position)
        data_b, _ = side_b.data(c.b, "input", position)
        if data_a is None or data_b is None or data_a.dtype != data_b.dtype \
                or data_a.shape != data_b.shape or not torch.equal(data_a, data_b):
            return None
    try:
        call_a, call_b = side_a.dump.call(c.a.index), side_b.dump.call(c.b.index)
    except ProbeError:
        return None
    scalars_a, scalars_b = _scalar_arguments(call_a), _scalar_arguments(call_b)
    differing = [_argument_difference(where, scalars_a.get(where), scalars_b.get(where))
                 for where in sorted(set(scalars_a) | set(scalars_b))
                 if scalars_a.get(where) != scalars_b.get(where)]
    if not differing:
        return None
    return (f"its tensor inputs are identical in both runs, but it was called with other arguments "
            f"({'; '.join(differing)})")
