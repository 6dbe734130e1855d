"""Run against run: matched ops, metrics, verdicts, and the first divergence.

``compare(a, b)`` treats run A as the reference. Per (step, rank) found in both, ops are matched
(``matching``, confirmed by ``crossed_dataflow``), each matched pair's outputs are measured on
dumped data when both runs hold it, else on statistics, else on shape and dtype alone
(``step_sides``, ``metrics``, ``verdicts``). When both runs dumped the step but a tensor's data
is missing or unreadable on either side, the output is "not compared" (with the reason, and the
statistics' metrics beside it when known): missing data is never taken for agreement. What is not
a pass is then judged with the precision each run computed it in (``judging``,
``probe.analysis.precision``): a difference that the inputs' differences and each run's rounding
explain is a warning (by an fp64 replay of the op on each run's dumped inputs, else by a bound on
the propagation: ``judging.propagation``), an op of B lowering precision unexplained by B's policy
is an error, and so is a difference that enters at an op (through values of one run only:
``judging.boundaries``; from state the steps before do not explain: ``judging.carried_state``).
Each verdict records its ``rule``. The **first divergence** is the earliest op where a divergence
enters (``judging.step``); from it, the **chain** follows A's graph through the consumers that
diverge too. The result is a ``Report`` (``comparison_report``), its records ``comparison_records``.

This module drives it: the work splits into pieces of one step of one rank (``compare_pieces``),
matched in parallel processes or on a cluster and judged here in step order, each step handed
what the one before found; tensors are read one op at a time through memory maps, so memory is
bounded by the largest op, not the run.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from probe.analysis import precision
from probe.analysis.compare_pieces import run_pieces
from probe.analysis.comparison_records import Carry, OpComparison, StepComparison
from probe.analysis.comparison_report import Report
from probe.analysis.compiled_regions import compare_notes, opened_regions, replayed_ops
from probe.analysis.judging.propagation import REPLAY_LIMIT
from probe.analysis.judging.step import judge_step
from probe.analysis.layouts import LogicalRun, LogicalStep, layout_notes, logical_pair
from probe.analysis.matching import MICRO_BATCHES, mapped_id, match_ops, rename_module
from probe.analysis.micro_batches import MicroBatches, Unfoldable, accumulation_end, micro_batches
from probe.analysis.micro_batches import fold as fold_micro_batches
from probe.analysis.run_identity import identity
from probe.analysis.step_sides import MatchedStep, Side, compare_pair
from probe.analysis.verdicts import NOT_COMPARED, RULE_NOT_COMPARED
from probe.errors import ProbeError
from probe.rundir.run import OpRecord, Run


def _micro_batch_rows(ops_a: list[OpRecord], ops_b: list[OpRecord], structure: MicroBatches, step: int,
                      rank: int, module_map: dict[str, str] | None) -> list[OpComparison]:
    """The rows of the micro-batches' ops: "not compared", with the reason. An op of run A is
    shown beside run B's op of its id (the first micro-batch's) for reading, not measured."""
    by_id = {mapped_id(op, module_map or {}): op for op in ops_b}
    rows = []
    for a in ops_a:
        b = by_id.pop(a.id, None)
        rows.append(OpComparison(step, rank, a, b, MICRO_BATCHES, NOT_COMPARED, structure.reason,
                                 rule=RULE_NOT_COMPARED))
    unpaired = {id(b) for b in by_id.values()}  # the later micro-batches', in run B's order
    rows += [OpComparison(step, rank, None, b, MICRO_BATCHES, NOT_COMPARED, structure.reason,
                          rule=RULE_NOT_COMPARED) for b in ops_b if id(b) in unpaired]
    return rows

def _fold_micro_batches(side_a: Side, side_b: Side, structure: MicroBatches,
                        module_map: dict[str, str]) -> bool:
    """Folds the side that took several micro-batches into one batch against the other's one
    (False: neither took one batch, or the micro-batches are laid out otherwise, and the
    micro-batches stay "not compared")."""
    def b_id(op: OpRecord) -> str:
        return mapped_id(op, module_map)
    try:
        if structure.calls_a == 1:
            side_b.fold(fold_micro_batches(side_b.ops, structure.calls_b, side_a.ops, b_id, lambda op: op.id))
        elif structure.calls_b == 1:
            side_a.fold(fold_micro_batches(side_a.ops, structure.calls_a, side_b.ops, lambda op: op.id, b_id))
        else:
            return False
    except Unfoldable:
        return False
    return True

def match_step(run_a: Run, run_b: Run, step: int, rank: int, module_map: dict[str, str] | None = None,
               on_op: Callable[[], None] | None = None) -> MatchedStep:
    """The part of :func:`compare_step` that reads this step alone: the ops matched and each
    pair measured, and the precision each run computed in."""
    side_a, side_b = Side(run_a, step, rank), Side(run_b, step, rank)
    structure = micro_batches(side_a.ops, side_b.ops, lambda module: rename_module(module, module_map or {}))
    comparisons: list[OpComparison] = []
    if structure is not None and _fold_micro_batches(side_a, side_b, structure, module_map or {}):
        structure = None  # folded: compared as two steps of one batch
    ops_a, ops_b = side_a.ops, side_b.ops
    if structure is not None:  # the micro-batches' forward and backward: not compared op for op
        end_a, end_b = accumulation_end(ops_a), accumulation_end(ops_b)
        comparisons = _micro_batch_rows(ops_a[:end_a], ops_b[:end_b], structure, step, rank, module_map)
        ops_a, ops_b = ops_a[end_a:], ops_b[end_b:]
        if on_op is not None:
            for _ in range(end_a):
                on_op()
    replayed = ((set(), set()) if side_a.folded or side_b.folded else replayed_ops(run_b, step, rank))
    matches = match_ops(ops_a, ops_b, module_map, *replayed)
    for m in matches:
        comparisons.append(compare_pair(side_a, side_b, m, step, rank))
        if on_op is not None and m.a is not None:
            on_op()
    partner_of_b = {m.b.index: m.a for m in matches if m.a is not None and m.b is not None}
    lowerings = precision.lowered_precision(ops_a, ops_b, partner_of_b)
    # A compiled region whose graph was re-run node by node is judged at its nodes' ops.
    opened = opened_regions(run_b, step, rank)
    lowerings = {i: low for i, low in lowerings.items() if low.op.id not in opened}
    policy = precision.describe_policy(side_a.ops, side_b.ops)
    folded = tuple(run.logical_step(step) if isinstance(run, LogicalRun) else None for run in (run_a, run_b))
    return MatchedStep(step, rank, (side_a, side_b), comparisons, lowerings, policy, folded)

def compare_step(run_a: Run, run_b: Run, step: int, rank: int,
                 module_map: dict[str, str] | None = None,
                 on_op: Callable[[], None] | None = None,
                 replay_limit: int = REPLAY_LIMIT, carry: Carry | None = None) -> StepComparison:
    """Compares one step of one rank; ``carry``: what the steps compared before it hand on."""
    return judge_step(run_a, match_step(run_a, run_b, step, rank, module_map, on_op), replay_limit, carry)

def _unreadable_step(run_a: Run, run_b: Run, step: int, rank: int, reason: str) -> StepComparison:
    """A step one run (or both) cannot read: each op of a run that can is "not compared", with
    the reason (paired by id when both runs read their ops)."""
    why = {side: damage for side, run in (("A", run_a), ("B", run_b))
           if (damage := run.step_damage(step, rank)) is not None}
    message = "; ".join(f"run {side}: unreadable: {damage}" for side, damage in why.items()) or \
        f"unreadable: {reason}"
    rows = _rows_not_compared(run_a, run_b, step, rank, "not read", message)
    return StepComparison(step, rank, rows, None, unreadable=message)

def _apart_step(run_a: Run, run_b: Run, step: int, rank: int, apart: str) -> StepComparison:
    """A step after the runs' training parted (``StepComparison.apart``): each op "not compared"."""
    message = f"not compared: {apart}"
    return StepComparison(step, rank, _rows_not_compared(run_a, run_b, step, rank, "apart", message), None,
                          apart=apart)

def _rows_not_compared(run_a: Run, run_b: Run, step: int, rank: int, match: str,
                       message: str) -> list[OpComparison]:
    """A "not compared" row per op of each run that can read the step (paired by id where both can)."""
    ops: dict[str, list[OpRecord]] = {}
    for side, run in (("A", run_a), ("B", run_b)):
        try:
            ops[side] = run.ops(step, rank)
        except ProbeError:
            ops[side] = []
    by_id = {op.id: op for op in ops["B"]}
    pairs = [(a, by_id.pop(a.id, None)) for a in ops["A"]] + [(None, b) for b in by_id.values()]
    return [OpComparison(step, rank, a, b, match, NOT_COMPARED, message, rule=RULE_NOT_COMPARED)
            for a, b in pairs]

def _match_piece(spec_a: tuple[str, bool], spec_b: tuple[str, bool], partitions: dict[str, str | int] | None,
                 step: int, rank: int, module_map: dict[str, str] | None) -> MatchedStep | str:
    """A piece of a compare, run wherever the executor puts it: reopens both runs by path
    (``(path, folded)``) and matches one step, or says why the step cannot be read."""
    run_a, run_b = (LogicalRun(Run(path), partitions) if folded else Run(path)
                    for path, folded in (spec_a, spec_b))
    try:
        return match_step(run_a, run_b, step, rank, module_map)
    except ProbeError as e:
        return str(e)

def compare(
    a: str | Path | Run, b: str | Path | Run, steps: list[int] | None = None,
    ranks: list[int] | None = None, module_map: dict[str, str] | None = None,
    processes: int | None = None, progress: Callable[[int, int], None] | None = None,
    replay_limit: int = REPLAY_LIMIT, partitions: dict[str, str | int] | None = None,
    executor: Executor | None = None,
) -> Report:
    """Compare run ``b`` against the reference run ``a``; see the module docstring.

    ``progress(done, total)`` is called as ops of run A are compared. ``replay_limit``:
    ops whose inputs hold more elements (in either run) are judged by the propagation
    bound instead of an fp64 replay; 0 disables the replay. ``partitions``: for tensor
    parallelism written by hand (no DTensor), module (or glob) -> ``"colwise"``,
    ``"rowwise"`` or the weight's sharded dim, so that its shards fold into whole tensors
    (``probe.analysis.layouts.normalize_partitions``).

    The work splits into pieces of one step of one rank (one step of a folded run), see
    ``probe.analysis.compare_pieces``: ``processes=N`` runs them in N spawned processes
    (default: one per rank when ranks are compared one by one, else this process);
    ``executor``, any :class:`concurrent.futures.Executor` (a Dask cluster's:
    ``compare_pieces.cluster_executor``), runs them there, on workers that read the runs under
    the same paths. The report is the same wherever the pieces ran.
    """
    if type(replay_limit) is not int or replay_limit < 0:
        raise ProbeError(f"replay_limit must be a non-negative int, got {replay_limit!r}")
    run_a = a if isinstance(a, Run) else Run(a)
    run_b = b if isinstance(b, Run) else Run(b)
    # Runs over several ranks or with DTensor placements compare as logical ops (layouts.py).
    run_a, run_b = logical_pair(run_a, run_b, partitions)
    missing: list[str] = []
    plan: dict[int, list[int]] = {}
    for rank in sorted(set(run_a.ranks) | set(run_b.ranks)):
        if ranks is not None and rank not in ranks:
            continue
        if rank not in run_a.ranks or rank not in run_b.ranks:
            missing.append(f"rank {rank} is only in run {'A' if rank in run_a.ranks else 'B'}")
            continue
        steps_a, steps_b = set(run_a.steps_of(rank)), set(run_b.steps_of(rank))
        for step in sorted(steps_a ^ steps_b):
            if steps is None or step in steps:
                missing.append(f"step {step} of rank {rank} is only in run {'A' if step in steps_a else 'B'}")
        common = sorted(steps_a & steps_b)
        plan[rank] = [s for s in common if steps is None or s in steps]
    if not any(plan.values()):
        raise ProbeError(f"{str(run_a.path)!r} and {str(run_b.path)!r} have no step and rank in common"
                         + (f" ({'; '.join(missing)})" if missing else ""))
    sizes = {(s, r): _op_count(run_a, s, r) for r, ss in plan.items() for s in ss}
    total, done = sum(sizes.values()), 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    results = _compare_pieces(run_a, run_b, plan, module_map, replay_limit, partitions,
                              _workers(plan, processes), executor, sizes, advance)
    return Report(run_a.path, run_b.path, sorted(results, key=lambda s: (s.step, s.rank)), missing,
                  identity(run_a, run_b, _readable_plan(plan, results)),
                  compare_notes(run_a, run_b) + layout_notes(run_a, run_b))

def _workers(plan: dict[int, list[int]], processes: int | None) -> int:
    """How many processes compare the pieces: ``processes``, else one per rank when ranks are
    compared one by one (a folded run, one logical rank, stays in this process unless asked)."""
    if not processes:  # None (and 0, as before)
        return len(plan)
    if type(processes) is not int or processes < 0:
        raise ProbeError(f"processes must be a positive int, got {processes!r}")
    return processes

def _compare_pieces(run_a: Run, run_b: Run, plan: dict[int, list[int]], module_map: dict[str, str] | None,
                    replay_limit: int, partitions: dict[str, str | int] | None, workers: int,
                    executor: Executor | None, sizes: dict[tuple[int, int], int],
                    advance: Callable[[int], None]) -> list[StepComparison]:
    """Compares the plan (rank -> steps) as pieces of one step of one rank
    (``probe.analysis.compare_pieces``), matched wherever they run and judged here, per rank in
    step order as the pieces complete: each step is handed what the one before found
    (:class:`Carry`); a gap in the steps (a step one run lacks, or not asked for) or an
    unreadable step breaks the chain, and what the runs carry across it is judged as at a
    first step."""
    specs = tuple((str(run.path), isinstance(run, LogicalRun)) for run in (run_a, run_b))
    matched: dict[tuple[int, int], MatchedStep | str] = {}
    judged: dict[tuple[int, int], StepComparison] = {}
    next_of = dict.fromkeys(plan, 0)  # per rank, the position in its steps to judge next
    ran_here: set[tuple[int, int]] = set()  # pieces that advanced the progress op by op

    def here(piece: tuple[int, int]) -> MatchedStep | str:
        step, rank = piece
        ran_here.add(piece)
        try:
            return match_step(run_a, run_b, step, rank, module_map, advance)
        except ProbeError as e:
            return str(e)

    def judge_ready(rank: int) -> None:
        steps = plan[rank]
        while next_of[rank] < len(steps) and (steps[next_of[rank]], rank) in matched:
            i = next_of[rank]
            step = steps[i]
            earlier = judged.get((steps[i - 1], rank)) if i else None
            before = earlier if earlier is not None and steps[i - 1] == step - 1 else None
            carry = before.carry if before is not None and before.unreadable is None else None
            result = matched.pop((step, rank))
            if earlier is not None and earlier.apart is not None:  # the runs trained apart since
                judged[step, rank] = _apart_step(run_a, run_b, step, rank, earlier.apart)
            else:
                judged[step, rank] = _judged(run_a, run_b, result, step, rank, replay_limit, carry)
            next_of[rank] += 1

    def done(piece: tuple[int, int], result: MatchedStep | str) -> None:
        step, rank = piece
        if isinstance(result, MatchedStep):
            for run, folded in zip((run_a, run_b), result.folded, strict=True):
                if folded is not None:  # first: a folded run's dump is read through its fold
                    _adopt_folded(run, folded)
            for side, run in zip(result.sides, (run_a, run_b), strict=True):
                side.attach(run, step, rank)
        if piece not in ran_here:
            advance(sizes.get(piece, 0))
        matched[piece] = result
        judge_ready(rank)

    pieces = [(step, rank) for rank, steps in plan.items() for step in steps]
    run_pieces(pieces, here, _match_piece,
               lambda piece: (specs[0], specs[1], partitions, piece[0], piece[1], module_map),
               done, workers, executor)
    return list(judged.values())

def _judged(run_a: Run, run_b: Run, matched: MatchedStep | str, step: int, rank: int, replay_limit: int,
            carry: Carry | None) -> StepComparison:
    """A matched step judged, or one that could not be read (``matched`` is then the reason)."""
    if isinstance(matched, str):
        return _unreadable_step(run_a, run_b, step, rank, matched)
    try:
        return judge_step(run_a, matched, replay_limit, carry)
    except ProbeError as e:  # a damaged step: its ops are not compared, the other steps are
        return _unreadable_step(run_a, run_b, step, rank, str(e))


def _adopt_folded(run: Run, folded: LogicalStep) -> None:
    """Keeps a logical step folded in another process in this process's folded run, so that
    what reads it here (the replica findings of :func:`layout_notes`) does not fold it again.
    ``LogicalRun`` memoises its steps in ``_steps``; seeded from here rather than by a new
    method there while ``layouts.py`` is being changed by another line of work."""
    if isinstance(run, LogicalRun):
        run._steps.setdefault(folded.step, folded)

def _readable_plan(plan: dict[int, list[int]], results: list[StepComparison]) -> dict[int, list[int]]:
    """``plan`` without the steps that could not be read."""
    unread = {(s.step, s.rank) for s in results if s.unreadable is not None}
    return {rank: [s for s in steps if (s, rank) not in unread] for rank, steps in plan.items()}

def _op_count(run: Run, step: int, rank: int) -> int:
    """How many ops a step holds, from its manifest (no need to load them to size a progress bar)."""
    try:
        count = run.step_info(step, rank).manifest.get("ops")
        return count if type(count) is int and count >= 0 else len(run.ops(step, rank))
    except ProbeError:  # a damaged step: compared as "not compared" when its turn comes
        return 0
