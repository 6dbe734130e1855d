"""Which op of run B corresponds to which op of run A.

First by stable id: the same program gives the same ids, and since an id
counts ops per (module call, phase, op name), an extra op (a cast under
autocast) shifts only the ids of its own kind. What is left is aligned within
each module call by sequence alignment over ``(op name, output kinds, output
shapes)`` and then over names and kinds alone, so a fused op on one side or a
different decomposition leaves the rest of its module matched. Ops whose results
are other kinds of value (float, integer, bool) are never paired. The remainder is listed
as unmatched on its side; nothing is dropped. ``module_map`` renames modules
of run B (``{"encoder": "model.encoder"}``) before matching.
"""

from __future__ import annotations

import difflib
from collections import Counter, defaultdict
from dataclasses import dataclass

from probe.analysis.crossed_dataflow import refuse_crossed
from probe.analysis.precision import VALUE_CASTS, short_name
from probe.rundir.run import OpRecord
from probe.vocabulary.op_class import reads_shape_only


@dataclass
class Match:
    a: OpRecord | None
    b: OpRecord | None
    how: str
    """"id", "aligned" or "unmatched" (or ``MICRO_BATCHES`` on a row compare shows unmeasured)."""


MICRO_BATCHES = "micro-batches"
"""How a row of a step's micro-batches is matched: shown beside its twin, not compared
(:mod:`probe.analysis.micro_batches`)."""


def rename_module(module: str, module_map: dict[str, str]) -> str:
    """Run B's module ``module`` in run A's names (the longest key of ``module_map`` it is in)."""
    for old in sorted(module_map, key=len, reverse=True):
        if module == old or module.startswith(old + "."):
            return module_map[old] + module[len(old):]
    return module


def mapped_id(op: OpRecord, module_map: dict[str, str]) -> str:
    """B's op id with its module renamed into A's names (ids are ``phase:fqn[call]:name:n``)."""
    if not module_map or not op.module:
        return op.id
    phase, rest = op.id.split(":", 1)
    frame, name, n = rest.rsplit(":", 2)
    renamed = rename_module(op.module, module_map) + frame[len(op.module):]
    return f"{phase}:{renamed}:{name}:{n}"


def _parameter(op: OpRecord, module_map: dict[str, str]) -> str | None:
    """The parameter an optimizer op works for, in run A's names (None: not known, or not one)."""
    if op.parameter is None:
        return None
    return rename_module(op.parameter, module_map) if module_map else op.parameter


def _pairing_ids(ops: list[OpRecord], module_map: dict[str, str]) -> dict[int, str]:
    """Op index -> the id ops are paired by: the op id, except for an optimizer op that works for
    one parameter, numbered within that parameter (``...:aten.lerp_.Scalar@layers.0.up.weight:0``).
    Two runs whose optimizers update different parameters (a compiled backward gives zeros where
    the eager one leaves a gradient None) number one parameter's ops alike only this way."""
    ids: dict[int, str] = {}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for op in ops:
        parameter = _parameter(op, module_map) if op.phase == "optimizer" else None
        if parameter is None:
            ids[op.index] = mapped_id(op, module_map)
            continue
        prefix = mapped_id(op, module_map).rsplit(":", 1)[0]
        n = counts[prefix, parameter]
        counts[prefix, parameter] = n + 1
        ids[op.index] = f"{prefix}@{parameter}:{n}"
    return ids


ALIGN_LIMIT = 2048
"""The most ops of one name in one module call that are aligned rather than paired by id where the
runs hold different numbers of them: sequence alignment of n like tokens costs about n^2 (2,000 of
them 0.8 s, 4,000 3 s); beyond it the ids pair them, shifted or not."""


def _numbered(op_id: str) -> str:
    """What an id numbers its op within: the id without its count."""
    return op_id.rsplit(":", 1)[0]


def _reads_values(op: OpRecord) -> bool:
    """Whether ``op`` reads the values of a tensor: an op that does not is a constant of its call."""
    return bool(op.inputs) and not reads_shape_only(op.name)


def _token(op: OpRecord, with_shapes: bool, with_sources: bool = False) -> str:
    # The kind of value each result is, always: a cast to integers (``gates.long()``) is no twin
    # of a cast to float that one run alone makes first (``logits.float()`` of a bf16 matmul), and
    # sharing the name and the n-th place would pair them.
    kinds = "".join("f" if t.floating else "b" if t.dtype == "bool" else "i" for t in op.outputs)
    if not with_shapes:
        return f"{op.name}|{kinds}"
    token = f"{op.name}|{kinds}|" + ";".join(",".join(map(str, t.shape)) for t in op.outputs)
    if with_sources:
        # Which inputs the step computed and which it read from outside (a weight): a norm's
        # ``x * rsqrt(...)`` and ``weight * x`` are both a ``mul`` of one shape; a third ``mul``
        # one run adds after them (a scaling) reads one tensor.
        token += "|" + "".join("o" if t.source is None else "s" for t in op.inputs)
    return token


def _input_shapes(op: OpRecord) -> list[tuple[int, ...]]:
    return [t.shape for t in op.inputs]


def _group_key(op: OpRecord, module_map: dict[str, str] | None = None) -> tuple[str, str, int, str | None]:
    module = rename_module(op.module, module_map) if module_map else op.module
    return op.phase, module, op.module_call, _parameter(op, module_map or {})


def _one_program(ops_a: list[OpRecord], ops_b: list[OpRecord]) -> bool:
    """Whether two runs' ops of a module call are one program: the same op names, apart from the
    casts one run adds (autocast's)."""
    def names(ops: list[OpRecord]) -> set[str]:
        return {op.name for op in ops if short_name(op.name) not in VALUE_CASTS}
    return names(ops_a) == names(ops_b)


def _align(ops_a: list[OpRecord], ops_b: list[OpRecord], with_shapes: bool,
           with_sources: bool) -> list[tuple[int, int]]:
    matcher = difflib.SequenceMatcher(
        a=[_token(op, with_shapes, with_sources) for op in ops_a],
        b=[_token(op, with_shapes, with_sources) for op in ops_b],
        autojunk=False,
    )
    pairs = []
    for block in matcher.get_matching_blocks():
        pairs += [(block.a + k, block.b + k) for k in range(block.size)]
    return pairs


def match_ops(
    ops_a: list[OpRecord], ops_b: list[OpRecord], module_map: dict[str, str] | None = None,
    shapes_only: set[int] | None = None, unpaired: set[int] | None = None,
) -> list[Match]:
    """Matches in run A's execution order; B-only ops follow the A op their predecessor matched.

    ``shapes_only``: indices of B ops matched only to an op with the same input and output
    shapes (ops a compiled region's graph re-run recorded: its decomposition orders and shapes
    views its own way, and a view of another shape there is no divergence). ``unpaired``:
    indices of B ops left unmatched (a re-run backward graph's: AOTAutograd orders a backward
    its own way, so ops of one name and shape there are not the eager twin's in turn)."""
    module_map = module_map or {}
    shapes_only = shapes_only or set()
    unpaired = unpaired or set()
    ids_b = _pairing_ids(ops_b, module_map)
    by_id = {ids_b[op.index]: op for op in ops_b if op.index not in unpaired}
    ids_a = _pairing_ids(ops_a, {})
    # An id numbers the ops of one name in one module call; where the runs hold a different number
    # of them (a cast autocast adds, a loss's cast outside every module), the n-th of one run is not
    # the n-th of the other from the first extra one on: those are aligned below, in order.
    counts_a, counts_b = Counter(map(_numbered, ids_a.values())), Counter(map(_numbered, ids_b.values()))
    shifted = {numbered for numbered in counts_a.keys() | counts_b.keys()
               if counts_a[numbered] != counts_b[numbered]
               and max(counts_a[numbered], counts_b[numbered]) <= ALIGN_LIMIT}
    partner: dict[int, OpRecord] = {}
    how: dict[int, str] = {}
    taken: set[int] = set()
    for op in ops_a:
        if _numbered(ids_a[op.index]) in shifted:
            continue
        other = by_id.get(ids_a[op.index])
        # Same id, other output shapes: ids shifted (an extra op of that name on one side,
        # e.g. a detach autocast adds in backward); alignment pairs them better.
        if other is not None and _token(other, True) == _token(op, True) and (
                other.index not in shapes_only or _input_shapes(other) == _input_shapes(op)):
            partner[op.index], how[op.index] = other, "id"
            taken.add(other.index)

    groups_a: dict[tuple, list[OpRecord]] = defaultdict(list)
    groups_b: dict[tuple, list[OpRecord]] = defaultdict(list)
    for op in ops_a:
        if op.index not in partner:
            groups_a[_group_key(op)].append(op)
    for op in ops_b:
        if op.index not in taken and op.index not in unpaired:
            groups_b[_group_key(op, module_map)].append(op)
    for key, left in groups_a.items():
        right = groups_b.get(key, [])
        # Finest first: in one program, alike ops that also read alike (computed or outside
        # values), then alike in shapes, then in name. Like tokens in a row otherwise align with
        # the longest run of them, whichever ops it holds (a norm's two ``mul``s with the last two
        # of three). Two decompositions (eager attention's backward against SDPA's) read their
        # values each its own way: where each reads what says nothing of which op is which.
        levels = ((True, True), (True, False), (False, False)) if _one_program(left, right) \
            else ((True, False), (False, False))
        for with_shapes, with_sources in levels:
            # By name alone, never an op reading no tensor's values (``zeros``, ``arange``,
            # ``new_zeros``): its shape is all there is to its value, and one of another shape is
            # another constant (autograd's zeros for a gradient one run's backward did not produce,
            # paired with the other run's zeros of another gradient, or with SDPA's empty one).
            remaining_a = [op for op in left
                           if op.index not in partner and (with_shapes or _reads_values(op))]
            remaining_b = [op for op in right if op.index not in taken
                           and (with_shapes or (op.index not in shapes_only and _reads_values(op)))]
            if not remaining_a or not remaining_b:
                break
            for i, j in _align(remaining_a, remaining_b, with_shapes, with_sources):
                partner[remaining_a[i].index], how[remaining_a[i].index] = remaining_b[j], "aligned"
                taken.add(remaining_b[j].index)
    # Where two decompositions of a module call differ, pairs by position are other values.
    refuse_crossed(ops_a, ops_b, partner, lambda op: _group_key(op)[1:],
                   lambda op: _group_key(op, module_map)[1:], shapes_only)

    # B-only ops are placed after the A op matched to their nearest earlier B op.
    a_of_b = {other.index: a_index for a_index, other in partner.items()}
    b_only: dict[int, list[OpRecord]] = defaultdict(list)
    anchor = -1
    for op in ops_b:
        if op.index in a_of_b:
            anchor = a_of_b[op.index]
        else:
            b_only[anchor].append(op)
    matches = [Match(None, op, "unmatched") for op in b_only.get(-1, [])]
    for op in ops_a:
        other = partner.get(op.index)
        matches.append(Match(op, other, how[op.index]) if other else Match(op, None, "unmatched"))
        matches += [Match(None, b, "unmatched") for b in b_only.get(op.index, [])]
    return matches
