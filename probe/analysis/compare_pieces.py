"""A compare split into independent pieces of work, run here, in processes, or on a cluster.

A piece is one step of one rank: a folded run (``probe.analysis.layouts``) has one logical
rank, so its pieces are its steps, each reading and folding every rank's records of that step.
A piece reads both runs' step, folds it, matches the ops and measures each matched pair
(statistics, dumped data): everything that depends on that step alone, and most of the time a
compare takes (reading and folding the ranks' records, measured in
``benchmarks/compare_scale.py``). Pieces of one compare share nothing, so they run in any order,
in any process, on any machine that sees the run directories under the same paths (a shared
file system): a piece names its runs by path and reopens them where it runs.

What a piece cannot decide is the verdict: a step's judgement reads what the steps before it on
the same rank hand on (``compare.Carry``: whether the runs were bit-identical so far, whether a
divergence entered, the state they left). Judging is therefore a chain per rank, done by the
caller in step order as soon as the pieces before it are in (:func:`run_pieces` reports each
piece as it completes), and the result is the serial compare's, op for op.

Not per logical module: within a step, module boundaries are not independent. The folding
follows each value from the op that made it to the ops that read it, wherever they are (an
input takes its producer's folded value and placement; a plain op between two parallel modules
takes its placement from its input), matching pairs ops by module and order but leaves ops that
move between modules (TP's residual gradient ``add``) unmatched, and the judgement carries a
divergence from an op to its readers in later modules and names the earliest op over the whole
step. A piece per module would need the whole step's provenance anyway, so the step of a rank
group (every rank of the folded mesh, or one rank when ranks are compared one by one) is the
smallest piece that gives the serial answer.

Where pieces run: in this process (one worker), in spawned processes on this machine
(``processes=N``), or on any :class:`concurrent.futures.Executor`: a Dask cluster's
``Client(address).get_executor()`` (the ``cluster`` extra; ``probe compare --scheduler
ADDRESS``), whose workers must see the runs under the same paths.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any, TypeVar

from probe.errors import ProbeError

P = TypeVar("P", bound=Hashable)
R = TypeVar("R")


def run_pieces(pieces: Sequence[P], here: Callable[[P], R], remote: Callable[..., R],
               remote_args: Callable[[P], tuple[Any, ...]], done: Callable[[P, R], None],
               workers: int = 1, executor: Executor | None = None) -> None:
    """Runs every piece and calls ``done(piece, result)`` in this process as each completes.

    With ``executor`` (any :class:`concurrent.futures.Executor`, e.g. a Dask cluster's), each
    piece runs there as ``remote(*remote_args(piece))``; else with ``workers > 1`` (and more than
    one piece), in that many spawned processes, at most one per piece; else in this process as
    ``here(piece)`` (which may use what this process has already opened). ``remote`` must be
    a module-level function and its arguments plain data (paths, ints): they are pickled to
    wherever the piece runs.
    """
    if executor is None and min(workers, len(pieces)) <= 1:  # a process to spawn would only wait
        for piece in pieces:
            done(piece, here(piece))
        return
    if executor is not None:
        _run_on(executor, pieces, remote, remote_args, done)
        return
    # Spawned, not forked: a fork of a process whose OpenMP pool has run (any torch CPU
    # kernel, the compiled metrics) deadlocks in the child's first parallel region.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(pieces)), mp_context=spawn) as pool:
        _run_on(pool, pieces, remote, remote_args, done)


def _run_on(executor: Executor, pieces: Sequence[P], remote: Callable[..., R],
            remote_args: Callable[[P], tuple[Any, ...]], done: Callable[[P, R], None]) -> None:
    futures: dict[Future, P] = {executor.submit(remote, *remote_args(piece)): piece for piece in pieces}
    try:
        for future in as_completed(futures):
            done(futures[future], future.result())
    except BaseException:
        for future in futures:  # a failed piece fails the compare: the rest need not run
            future.cancel()
        raise


@contextmanager
def cluster_executor(address: str) -> Iterator[Executor]:
    """A :class:`concurrent.futures.Executor` on the Dask scheduler at ``address``
    (``tcp://host:8786``), connected for the ``with`` block::

        with cluster_executor("tcp://head:8786") as executor:
            report = probe.compare(a, b, executor=executor)

    Needs the
    ``cluster`` extra (``pip install 'probe[cluster]'``: dask's ``distributed``); its workers
    must read the run directories under the paths given to compare (a shared file system)."""
    try:
        from distributed import Client
    except ImportError as e:
        raise ProbeError(f"a Dask scheduler ({address}) needs the cluster extra: "
                         f"pip install 'probe[cluster]' (dask's distributed: {e})") from None
    try:
        client = Client(address, timeout=30)
    except OSError as e:
        raise ProbeError(f"cannot reach the Dask scheduler at {address}: {e}") from None
    with client:
        yield client.get_executor()
