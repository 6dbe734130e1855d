"""The multi-tensor statistics kernel checked against exact fp64 statistics, on one device.

Run by ``tests/test_multi_tensor_rows.py``: on a CUDA device as is, on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported). Not collected by pytest
(the interpreter must be chosen before triton is imported, which a pytest process has done
already where torch brought triton in)::

    TRITON_INTERPRET=1 python tests/multi_tensor_checks.py cpu
    python tests/multi_tensor_checks.py cuda
"""

from __future__ import annotations

import math
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    # Triton 3.6's interpreter reads a loop bound with int() of a one-element array, which NumPy
    # 2 refuses; the compiled kernel never sees this.
    from triton.runtime import interpreter as _interpreter

    _patch_tensor = getattr(_interpreter, "_patch_lang_tensor", None)

    def _patch_with_scalar_index(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if _patch_tensor is not None:
        _interpreter._patch_lang_tensor = _patch_with_scalar_index

from probe.modes.statistics import multi_tensor, reduce, sketch
from probe.modes.statistics.columns import RAW_COLUMNS, raw_row

REL = 1e-7


def exact(x: torch.Tensor, threshold: float) -> list[float]:
    """The raw row by the table's eager forms in fp64 on the CPU (values as ``x`` holds them)."""
    return raw_row(x.detach().to("cpu", torch.float64).reshape(-1), threshold).tolist()


def check(got: list[float], want: list[float], what: str) -> None:
    for name, g, w in zip(RAW_COLUMNS, got, want, strict=True):
        if math.isnan(w) or math.isinf(w) or name in ("min", "max", "nan", "inf", "ninf", "zeros"):
            same = g == w or (math.isnan(g) and math.isnan(w))
            assert same, f"{what}: {name} {g!r} != {w!r}"
        else:
            assert abs(g - w) <= REL * abs(w), f"{what}: {name} {g!r} vs {w!r} ({abs(g - w) / abs(w):.2e})"


def tensors(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    block = multi_tensor.BLOCK
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for n in (1, 2, block - 1, block + 1, 3 * block * multi_tensor.MIN_BLOCKS_PER_PROGRAM + 5):
            out.append((f"{dtype} randn {n}", (torch.randn(n, generator=g) * 3).to(dtype)))
        # An fp16 sum of a million 100s overflows; an fp32 one is 1e-4 off: fp64 is exact.
        n = (1 << 20) + 3 if dtype in (torch.float16, torch.float32) else (1 << 16) + 3
        out.append((f"{dtype} constant {n}", torch.full((n,), 100.0).to(dtype)))
        ramp = torch.linspace(-1e3, 1e4, 70001).to(dtype)
        ramp[[5, 17, 40000]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
        ramp[[6, 7]] = torch.tensor([0.0, -0.0], dtype=dtype)
        out.append((f"{dtype} ramp with nan/inf/-inf/zeros", ramp))
        out.append((f"{dtype} all nan", torch.full((9,), math.nan, dtype=dtype)))
        out.append((f"{dtype} finfo.min mask", torch.full((4099,), torch.finfo(dtype).min, dtype=dtype)))
    return [(name, x.to(device)) for name, x in out]


def main(device: str) -> None:
    cases = tensors(device)
    # One batch per dtype, as the capture queue hands them over (tensors of every size together).
    for dtype in {x.dtype for _, x in cases}:
        batch = [(name, x) for name, x in cases if x.dtype == dtype]
        rows = multi_tensor.rows([x for _, x in batch], 0.5).cpu().tolist()
        for (name, x), row in zip(batch, rows, strict=True):
            check(row, exact(x, 0.5), name)
    # Strided views read in place (reduce.strided_layout): an attention head's half (two levels),
    # a slice in two dims of a 3-d tensor (three levels), with a contiguous tensor in the batch.
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        # (each made on the device, then sliced: .to() of a view copies it, contiguous, to a GPU)
        half = torch.randn(4, 4, 128, 64, generator=g).to(device, dtype)[..., :32]
        corner = torch.randn(4, 8, 64, generator=g).to(device, dtype)[:, :4, :32]
        corner[1, 2, 3] = math.nan
        plain = torch.randn(1000, generator=g).to(device, dtype)
        turned = torch.randn(4, 4, 64, 128, generator=g).to(device, dtype)[:, :, :32].transpose(-1, -2)
        four = torch.randn(4, 8, 8, 64, generator=g).to(device, dtype)[:, :4, :4, :32]
        assert reduce.strided_layout(half).sizes == (32, 4 * 4 * 128, 1)
        assert reduce.strided_layout(corner).sizes == (32, 4, 4)
        assert reduce.strided_layout(turned).sizes == (32 * 128, 16, 1)  # (in storage order)
        assert reduce.strided_layout(four).sizes == (32, 4, 4)
        batch = [half, corner, plain, turned, four]
        rows = multi_tensor.rows(batch, 0.5).cpu().tolist()
        for x, row, name in zip(batch, rows, ("half", "corner", "plain", "turned", "four"), strict=True):
            check(row, exact(x, 0.5), f"strided {dtype} {name}")
    assert reduce.strided_layout(torch.randn(4, 8, 8, 8, 64)[:, :4, :4, :4, :32]) is None  # five levels
    # Integers and bool, widened to fp64 in the kernel (exact below 2^53), one dtype per batch.
    assert multi_tensor.DTYPES == reduce.MULTI_TENSOR_DTYPES
    integers = [torch.arange(-5, 100000, dtype=torch.int64) * 3,
                torch.randint(0, 255, (5000,), dtype=torch.uint8),
                torch.rand(3000, generator=g) > 0.5,
                torch.randint(-100, 100, (77,), dtype=torch.int8),
                torch.randint(-1000, 1000, (4099,), dtype=torch.int16),
                torch.arange(70000, dtype=torch.int32)]
    for x in integers:
        x = x.to(device)
        check(multi_tensor.rows([x, x[: len(x) // 2]], 0.5)[0].cpu().tolist(), exact(x, 0.5), f"{x.dtype}")
    # The engine's routing: device_row_list sends contiguous float tensors to the kernel (any
    # dtype mix, one launch pair per dtype), the rest (a strided view, an int tensor) elsewhere.
    if device == "cpu":
        reduce.MULTI_TENSOR_DEVICES = ("cpu",)
    stats = reduce.TensorStats()
    x32 = torch.randn(5000, device=device)
    strided = torch.randn(300, 40, device=device)[:, ::3]
    unaligned = torch.randn(50001, device=device)[1:]  # 4 bytes past an aligned address
    half = torch.randn(4, 4, 128, 64, device=device)[..., :32]
    fp64 = torch.arange(7, device=device, dtype=torch.float64)
    mixed = [x32, x32.bfloat16(), strided, fp64, unaligned, half]
    assert stats.uses_multi_tensor(x32) and not stats.uses_multi_tensor(strided)
    calls = []
    kernel = reduce.multi_tensor_kernel(x32.device)

    def counted(xs, threshold):
        calls.append([x.dtype for x in xs])
        return kernel(xs, threshold)

    with reduce.multi_tensor_kernel_replaced(counted):
        rows = reduce.device_row_list(mixed, eps=0.25, stats=stats)
        # fp32, bf16, fp64, the unaligned fp32 and the strided fp32: one launch pair each.
        assert sorted(map(len, calls)) == [1, 1, 1, 1, 1], calls
        for x, row in zip(mixed, rows, strict=True):
            check(row.cpu().tolist(), exact(x, reduce.zeros_threshold(x.dtype, 0.25)), f"routed {x.dtype}")
        check(stats.row(x32).cpu().tolist(), exact(x32, 0.0), "TensorStats.row")
        assert len(calls) == 6
    check_sketches(device)
    print("ok", len(cases), "tensors")


def exact_sketch(x: torch.Tensor) -> torch.Tensor:
    """The projections by their definition, in fp64 on the CPU: ``sum_b block_b (x_b @ columns)``."""
    flat = reduce.as_real(x.detach()).reshape(-1).to("cpu", torch.float64)
    whole = -(-flat.numel() // sketch.BLOCK)
    padded = torch.cat([flat, flat.new_zeros(whole * sketch.BLOCK - flat.numel())])
    columns = sketch._signs.columns(torch.device("cpu"), torch.float64)
    blocks = sketch._signs.blocks(whole, torch.device("cpu"), torch.float64)
    return blocks @ (padded.view(whole, sketch.BLOCK) @ columns)


def check_sketch(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    want = exact_sketch(x)
    got = got.cpu()
    assert got.dtype == torch.float64 and got.shape == want.shape, (what, got.dtype, got.shape)
    scale = float(reduce.as_real(x.detach()).to("cpu", torch.float64).norm()) * math.sqrt(sketch.BLOCK)
    for g, w in zip(got.tolist(), want.tolist(), strict=True):
        if math.isnan(w):
            assert math.isnan(g), f"{what}: sketch {g!r}, expected NaN"
        else:
            assert abs(g - w) <= 1e-13 * scale + 1e-300, f"{what}: sketch {g!r} vs {w!r}"


def check_sketches(device: str) -> None:
    """The multi-tensor kernel with a sketch pattern's signs (``rows(xs, threshold, signs)``):
    each row as without them, followed by the projections' definition, for every float dtype, a
    tensor shorter than a block, one block, many programs of many blocks, NaN, a strided view
    (read in the order of its strides: its logical order where they decrease), in batches; and
    ``sketch.sketch`` routed to it where the kernel runs."""
    g = torch.Generator().manual_seed(2)
    dev = torch.device(device)
    block = sketch.BLOCK
    many = 4 * multi_tensor.BLOCK * multi_tensor.MIN_BLOCKS_PER_PROGRAM + 7  # several programs
    sizes = (1, 5, block - 1, block, block + 1, many)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        xs = [(torch.randn(n, generator=g) * 3).to(dtype).to(dev) for n in sizes]
        with_nan = torch.randn(3000, generator=g).to(dtype).to(dev)
        with_nan[1234] = math.nan
        xs.append(with_nan)
        signs = sketch.signs(dev, max(x.numel() for x in xs))
        out = multi_tensor.rows(xs, 0.5, signs).cpu()
        assert out.shape == (len(xs), reduce.WIDTH + sketch.SKETCHES), out.shape
        for x, row in zip(xs, out, strict=True):
            check(row[: reduce.WIDTH].tolist(), exact(x, 0.5), f"rows with sketches {dtype} {x.numel()}")
            check_sketch(row[reduce.WIDTH :], x, f"sketch {dtype} {x.numel()} (batch)")
    # (sliced on the device: .to() of a CPU view copies it, contiguous, where dev is not the CPU)
    half = torch.randn(4, 4, 128, 64, generator=g).to(dev)[..., :32]  # rotate_half's: strides decrease
    assert not half.is_contiguous() and reduce.strided_layout(half) is not None
    out = multi_tensor.rows([half, half[:, :2]], 0.0, sketch.signs(dev, half.numel())).cpu()
    for x, row in zip((half, half[:, :2]), out, strict=True):
        check_sketch(row[reduce.WIDTH :], x, f"sketch of a strided view {tuple(x.shape)}")
    # Views the engine queues in storage order (reduce.compact_view), sketched in their logical
    # order (sketch.batch_order): q or k after transpose(1, 2) (the engine reads it permuted,
    # contiguous), a gradient transposed in its last dims, rotate_half's halves of those (four
    # levels), beside a plain tensor and one of five levels in both orders, whose sketch is NaN
    # (never one of another order) while its statistics stay exact.
    heads = torch.randn(4, 128, 4, 64, generator=g).to(dev).transpose(1, 2)
    grad = torch.randn(4, 4, 64, 128, generator=g).to(dev).transpose(-1, -2)
    plain = torch.randn(3000, generator=g).to(dev)
    five = torch.randn(2, 128, 3, 5, 64, generator=g).to(dev).permute(0, 2, 1, 3, 4)[..., :32]
    views = [heads, grad, heads[..., 32:], grad[..., :32], plain, five]
    queued, positions = [], []
    for t in views:
        fits, order = sketch.batch_order(t) if not t.is_contiguous() else (True, None)
        assert fits or t is five, tuple(t.shape)
        queued.append(reduce.compact_view(t)[0])
        positions.append(order if t is not five else [1] * t.dim())
    assert queued[0].is_contiguous() and positions[0] is not None  # permuted back to storage order
    assert not queued[2].is_contiguous() and positions[2] is None  # read as it is
    signs = sketch.signs(dev, max(t.numel() for t in views))._replace(positions=positions)
    out = multi_tensor.rows(queued, 0.0, signs).cpu()
    for t, x, row in zip(views, queued, out, strict=True):
        check(row[: reduce.WIDTH].tolist(), exact(x, 0.0), f"rows of a view queued {tuple(t.shape)}")
        if t is five:
            assert torch.isnan(row[reduce.WIDTH :]).all(), row
        else:
            check_sketch(row[reduce.WIDTH :], t, f"sketch of a view queued {tuple(t.shape)} {t.stride()}")
    large = torch.randn((1 << 20) + 3, generator=g).to(dev)
    check_sketch(multi_tensor.rows([large], 0.0, sketch.signs(dev, large.numel()))[0, reduce.WIDTH :], large,
                 "sketch fp32 2^20 + 3")
    # sketch.sketch takes the kernel where the multi-tensor kernel runs: complex as its parts, a
    # non-contiguous tensor in its logical order (a copy), fp64.
    saved = reduce.MULTI_TENSOR_DEVICES
    reduce.MULTI_TENSOR_DEVICES = (device,)
    calls = []
    kernel = reduce.multi_tensor_kernel(dev)

    def counted(xs, threshold, signs=None):
        calls.append(signs is not None)
        return kernel(xs, threshold, signs)

    try:
        with reduce.multi_tensor_kernel_replaced(counted):
            cases = [torch.randn(3, 700, generator=g, dtype=torch.complex64).to(dev),
                     torch.randn(64, 96, generator=g).to(torch.bfloat16).to(dev).t(),
                     torch.randn(5000, generator=g, dtype=torch.float64).to(dev)]
            for x in cases:
                check_sketch(sketch.sketch(x), x, f"routed {x.dtype}")
            assert calls == [True, True, True], calls
    finally:
        reduce.MULTI_TENSOR_DEVICES = saved


if __name__ == "__main__":
    main(sys.argv[1])
