"""The monitor's per-tensor metrics, reduced on the tensor's device without a host sync.

One raw row per tensor (:data:`RAW_COLUMNS`): min, max, sum, sum of squares,
NaN count, Inf count, and the count of "zeros" (``|x| < eps``); the element
count is known on the host and travels beside it. Rows are in the
accumulation dtype of :mod:`probe.modes.tensor_stats` (values are widened
before they are reduced; never reduced in bf16/fp16). Rows of a step are
stacked on the device and moved to the host once; :func:`finalize` turns them
into :data:`METRIC_COLUMNS`. Like the stats mode, large tensors go through one
compiled pass and small ones through a few eager reductions.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.compiled import CompiledKernel
from probe.modes.tensor_stats import (
    COMPILED_MAX_NUMEL,
    COMPILED_MIN_NUMEL,
    accumulation_dtype,
    as_real,
    compact_view,
)

STAGED_NUMEL = 1 << 22
"""Elements staged for one batch of small tensors at most (its temporaries are a few times that)."""
SEGMENT_REDUCE_DEVICES = ("cuda",)
"""Where ``torch.segment_reduce`` has a kernel (elsewhere small tensors are reduced one by one)."""
RAW_COLUMNS = ("min", "max", "sum", "sumsq", "nan", "inf", "zeros")
METRIC_COLUMNS = ("min", "max", "mean", "norm", "zeros", "nans", "infs", "numel")


def _raw(flat: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """One pass over a 1-D tensor once compiled (the counts as in tensor_stats._fused_raw)."""
    x = flat if flat.dtype == torch.float64 else flat.to(torch.float32)
    wide = x.to(torch.float64)
    diff = x - x
    nan = (x != x).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    nonfinite = (diff != diff).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    zeros = (x.abs() < eps).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    return torch.stack([x.amin().to(torch.float64), x.amax().to(torch.float64), wide.sum(),
                        (wide * wide).sum(), nan, nonfinite - nan, zeros])


_COMPILED = CompiledKernel(_raw)


def _adam_update_raw(m: torch.Tensor, v: torch.Tensor, coefficients: torch.Tensor, eps: torch.Tensor
                     ) -> torch.Tensor:
    """The raw row of Adam's update ``lr * (m / c1) / (sqrt(v / c2) + adam_eps)`` without
    materializing it; ``coefficients`` = [lr / c1, 1 / c2, adam_eps]."""
    update = coefficients[0] * m.to(torch.float32) / ((v.to(torch.float32) * coefficients[1]).sqrt()
                                                       + coefficients[2])
    return _raw(update, eps)


_ADAM_UPDATE = CompiledKernel(_adam_update_raw)


def adam_update_row(m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float, beta2: float, adam_eps: float,
                    step: torch.Tensor | float, eps: float) -> tuple[torch.Tensor, int]:
    """The raw row of the step Adam took from its moments (decoupled weight decay not included).

    ``step`` is Adam's counter: a host number, or a device tensor (capturable and
    fused Adam), which is then used where it is, without a sync.
    """
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
        t = step.to(device=m.device, dtype=torch.float32)
        coefficients = torch.stack([lr / (1 - beta1**t), 1 / (1 - beta2**t), torch.full_like(t, adam_eps)])
    else:
        t = float(step)
        coefficients = torch.tensor([lr / (1 - beta1**t), 1 / (1 - beta2**t), adam_eps],
                                    dtype=torch.float32, device=m.device)
    threshold = torch.full((), eps, dtype=torch.float32, device=m.device)
    acc = accumulation_dtype(m.device)
    flat_m, flat_v = m.detach().reshape(-1), v.detach().reshape(-1)
    if COMPILED_MIN_NUMEL <= m.numel() < COMPILED_MAX_NUMEL and _ADAM_UPDATE.usable(m.device):
        return _ADAM_UPDATE(flat_m, flat_v, coefficients, threshold).to(acc), m.numel()
    return _adam_update_raw(flat_m, flat_v, coefficients, threshold).to(acc), m.numel()


def raw_row(t: torch.Tensor, eps: float) -> tuple[torch.Tensor, int]:
    """The raw row of ``t`` on its device and its element count (broadcast elements
    counted once per repetition: the metrics are those of the tensor the program sees)."""
    x, multiplicity = compact_view(as_real(t.detach()))
    acc = accumulation_dtype(x.device)
    numel = x.numel() * multiplicity
    if x.numel() == 0:
        return torch.tensor([np.nan, np.nan, 0, 0, 0, 0, 0], dtype=acc, device=x.device), 0
    threshold = torch.full((), eps, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype,
                           device=x.device)
    if COMPILED_MIN_NUMEL <= x.numel() < COMPILED_MAX_NUMEL and _COMPILED.usable(x.device):
        flat = (x if x.is_contiguous() else x.contiguous()).view(-1)
        row = _COMPILED(flat, threshold).to(acc)
    else:
        xa = x.to(acc)
        mn, mx = torch.aminmax(xa)
        nan = torch.isnan(xa).sum().to(acc)
        inf = torch.isinf(xa).sum().to(acc)
        zeros = (xa.abs() < threshold.to(acc)).sum().to(acc)
        row = torch.stack([mn, mx, xa.sum(), xa.square().sum(), nan, inf, zeros])
    if multiplicity == 1:
        return row, numel
    m = multiplicity
    return row * torch.tensor([1, 1, m, m, m, m, m], dtype=acc, device=x.device), numel


def raw_rows(tensors: list[torch.Tensor], eps: float) -> tuple[torch.Tensor, list[int]]:
    """The raw rows of many tensors of one device, stacked ``[len(tensors), 7]`` in their order,
    and their element counts: what :func:`raw_row` gives each (see :func:`raw_row_batches`)."""
    batches = raw_row_batches(tensors, eps)
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    for at, batch in batches:
        for j, i in enumerate(at):
            rows[i] = batch[j]
    return torch.stack([r for r in rows if r is not None]), [_numel(t) for t in tensors]


def _numel(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.is_complex() else 1)  # complex: its real and imaginary parts


def raw_row_batches(tensors: list[torch.Tensor], eps: float) -> list[tuple[list[int], torch.Tensor]]:
    """The raw rows of many tensors of one device, in batches: ``(positions in tensors, rows)``,
    each ``rows`` a ``[len(positions), 7]`` tensor in the accumulation dtype.

    Large tensors (``COMPILED_MIN_NUMEL`` elements and more) take :func:`raw_row`'s one-pass
    kernel each. Smaller ones are launch-bound on an accelerator: they are staged into one
    flat buffer (a copy of those small tensors only) and reduced per segment, about a
    dozen launches however many there are. On the CPU, where the staged buffer's
    temporaries cost more than the launches they save (measured: 96 tensors of 8-22k
    elements, 80-170 ms staged against 20-35 ms one by one), each is reduced in a few
    eager ops, its NaN and Inf counts skipped when its sum of squares is finite (a check
    that costs a CPU nothing). Devices without a segment-reduce kernel reduce them one by one.
    """
    device = tensors[0].device
    acc = accumulation_dtype(device)
    batches: list[tuple[list[int], torch.Tensor]] = []
    # Staged separately by whether they are fp64: raw_row compares others with eps rounded to fp32.
    small: dict[bool, tuple[list[torch.Tensor], list[int], list[int]]] = {}
    one_by_one = device.type not in ("cpu", *SEGMENT_REDUCE_DEVICES)
    for i, t in enumerate(tensors):
        x, multiplicity = compact_view(as_real(t.detach()))
        # Tensor subclasses (DTensor, ...) one by one: the batched ops may not be theirs.
        plain = type(x) in (torch.Tensor, torch.nn.Parameter)
        if x.numel() == 0 or x.numel() >= COMPILED_MIN_NUMEL or one_by_one or not plain:
            row = raw_row(t, eps)[0]
            batches.append(([i], (row if row.dtype == acc else row.to(acc))[None]))
        else:
            flats, at, repeats = small.setdefault(x.dtype == torch.float64, ([], [], []))
            flats.append(x.reshape(-1))
            at.append(i)
            repeats.append(multiplicity)
    for wide, (flats, at, repeats) in small.items():
        threshold = eps if wide else float(np.float32(eps))
        batch = _cpu_rows if device.type == "cpu" else _segment_rows
        start = total = 0
        for end, flat in enumerate(flats, 1):  # staged buffers of at most STAGED_NUMEL elements
            total += flat.numel()
            if total >= STAGED_NUMEL or end == len(flats):
                batches.append((at[start:end], batch(flats[start:end], repeats[start:end], threshold, acc)))
                start, total = end, 0
    return batches


def _cpu_rows(flats: list[torch.Tensor], repeats: list[int], eps: float, acc: torch.dtype) -> torch.Tensor:
    """Raw rows of small non-empty 1-D CPU tensors (as :func:`raw_row`'s eager form), without
    widened copies (fresh buffers cost page faults: most of the time here): extremes and
    comparisons in fp32, which widening to fp64 leaves exact, sums accumulated in ``acc``.
    ``eps`` is as the tensors' dtype holds it."""
    xs = [f if f.dtype in (torch.float32, torch.float64) else f.to(torch.float32) for f in flats]
    minima, maxima = zip(*(torch.aminmax(x) for x in xs), strict=True)
    sums = torch.stack([x.sum(dtype=acc) for x in xs])
    sumsq = torch.stack(torch._foreach_norm(xs, 2, dtype=acc)).square()
    zeros = torch.stack([torch.count_nonzero(x.abs() < eps) for x in xs]).to(acc)
    nan = torch.zeros(len(xs), dtype=acc)
    inf = torch.zeros(len(xs), dtype=acc)
    finite = torch.isfinite(sumsq)
    if not bool(finite.all()):  # a check that costs a CPU nothing; counts only where one is needed
        for i in torch.nonzero(~finite).flatten().tolist():
            nan[i], inf[i] = torch.isnan(xs[i]).sum(), torch.isinf(xs[i]).sum()
        # A NaN or an Inf makes the sum of squares non-finite; so does an fp64 overflow, where
        # the row keeps the sum of squares as raw_row does.
        sumsq = torch.where(finite, sumsq, torch.stack([(x.to(acc) ** 2).sum() for x in xs]))
    extremes = torch.stack([torch.stack(minima), torch.stack(maxima)], dim=1).to(acc)
    rows = torch.cat([extremes, torch.stack([sums, sumsq, nan, inf, zeros], dim=1)], dim=1)
    if any(m != 1 for m in repeats):
        rows = rows * torch.tensor([[1, 1, m, m, m, m, m] for m in repeats], dtype=acc)
    return rows


def _segment_rows(flats: list[torch.Tensor], repeats: list[int], eps: float, acc: torch.dtype
                  ) -> torch.Tensor:
    """Raw rows of non-empty 1-D tensors by segment reductions over one staged buffer."""
    device = flats[0].device
    lengths_host = torch.tensor([f.numel() for f in flats], dtype=torch.int64)
    # Pinned and non-blocking: a pageable host-to-device copy would wait for the device's queue.
    pin = device.type == "cuda"
    lengths = lengths_host.pin_memory().to(device, non_blocking=True) if pin else lengths_host.to(device)
    x = torch.cat(flats).to(acc)
    columns = [torch.segment_reduce(x, reduction, lengths=lengths) for reduction in ("min", "max")]
    # One temporary at a time.
    for summand in (lambda: x, lambda: x * x, lambda: torch.isnan(x), lambda: torch.isinf(x),
                    lambda: x.abs() < eps):
        columns.append(torch.segment_reduce(summand().to(acc), "sum", lengths=lengths))
    row = torch.stack(columns, dim=1)
    if any(m != 1 for m in repeats):
        scale = torch.tensor([[1, 1, m, m, m, m, m] for m in repeats], dtype=acc)
        row = row * (scale.pin_memory().to(device, non_blocking=True) if pin else scale.to(device))
    return row


def finalize(raw: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Raw rows and element counts -> ``[min, max, mean, norm, zeros, nans, infs, numel]`` (fp64).

    Means and norms are of the finite and non-finite values alike (NaN in, NaN out),
    as the tensor holds them.
    """
    out = np.empty((raw.shape[0], len(METRIC_COLUMNS)), dtype=np.float64)
    if raw.shape[0] == 0:
        return out
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        out[:, 0] = raw[:, 0]
        out[:, 1] = raw[:, 1]
        out[:, 2] = np.where(numel > 0, raw[:, 2] / np.where(numel > 0, numel, 1), np.nan)
        out[:, 3] = np.sqrt(raw[:, 3])
    out[:, 4] = raw[:, 6]
    out[:, 5] = raw[:, 4]
    out[:, 6] = raw[:, 5]
    out[:, 7] = numel
    return out
