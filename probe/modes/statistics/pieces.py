"""A large tensor reduced a bounded piece at a time, so the probe's temporaries stay bounded.

Every reduction that makes something of its input's size (a widened copy, a contiguous copy
of a slice with gaps, a mask, an index per element) makes it of one piece instead: at most
:data:`PIECE_NUMEL` elements. Before, an int8 tensor of 2^31 elements was widened whole to
fp64 (16 GiB) and the user's op raised ``MemoryError`` from the probe; a 2^27-element one
cost 622 MB of temporaries for 128 MB of data.

Pieces are reduced by the same kernels as a whole tensor, and their partial results are
combined as the statistics table says (``columns.RawColumn.combine``: min, max or sum),
in the accumulation dtype (fp64 on CPU and CUDA), so sums and norms stay within 1e-7 of
exact. A tensor of at most :data:`PIECE_NUMEL` elements is one piece: reduced exactly as
before, bit for bit. Reductions that read their input in place in one fused pass (a
contiguous floating-point tensor under the compiled kernels) make no temporary and are not
split.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from probe.modes.statistics.columns import combine_ops

PIECE_NUMEL = 1 << 24
"""Elements per piece: the widest temporary of a piece is 128 MiB (fp64). Read at call time
(tests lower it)."""

_MIN_COLUMNS, _MAX_COLUMNS, _ = combine_ops()  # every other column is a sum


def too_large(x: torch.Tensor) -> bool:
    """Whether ``x`` is reduced in more than one piece."""
    return x.numel() > PIECE_NUMEL


def split(x: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``x`` that hold each of its elements once, each of at most :data:`PIECE_NUMEL`
    elements (in memory order for a contiguous ``x``). Nothing is copied."""
    limit = PIECE_NUMEL
    if x.is_contiguous():
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
        return
    yield from _split_strided(x, limit)


def _split_strided(x: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    if x.numel() <= limit or x.dim() == 0:
        yield x
        return
    inner = x.numel() // x.shape[0]
    if inner <= limit:  # whole rows along the first dim, as many as fit
        rows = limit // inner
        for start in range(0, x.shape[0], rows):
            yield x.narrow(0, start, min(rows, x.shape[0] - start))
        return
    for i in range(x.shape[0]):  # one row is already too large: split each one
        yield from _split_strided(x[i], limit)


def combine_raw(rows: list[torch.Tensor]) -> torch.Tensor:
    """The raw row of a tensor from the raw rows of its pieces (each the first ``k`` raw
    columns, ``k`` the same for all: the moments ``[min, max, sum, sumsq]`` or a whole row),
    in their dtype and on their device. NaN propagates through min and max as ``amin`` does."""
    table = torch.stack(rows)
    width = table.shape[1]
    out = table.sum(0)
    for columns, reduce in ((_MIN_COLUMNS, torch.amin), (_MAX_COLUMNS, torch.amax)):
        for c in columns:
            if c < width:
                out[c] = reduce(table[:, c])
    return out


def sum_counts(counts: list[torch.Tensor]) -> torch.Tensor:
    """Counts of a tensor (the distribution's shares, a histogram) from those of its pieces."""
    return torch.stack(counts).sum(0)
