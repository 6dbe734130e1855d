"""Which ops may be run again on other values (perturbed, in a higher precision): the piece the
free benchmark and the upcast mode share, so that neither imports the other.

Factory ops, views, random ops, collectives, host syncs, compiled regions, ops whose outputs are
not initialized by them and pure data movement are never re-run: their outputs do not depend on
their inputs' values (or copy them), so a re-run tells nothing, or running them twice would change
the program (a collective, a random draw).
"""

from __future__ import annotations

from probe.vocabulary.op_class import OpClass

_DATA_MOVEMENT = frozenset({
    "clone", "_to_copy", "copy_", "copy", "contiguous", "detach", "lift_fresh", "alias", "_unsafe_view",
    "fill_", "zero_", "_local_scalar_dense", "set_", "resize_",
})
"""Ops whose outputs do not depend on their inputs' values (or copy them), beside those reading
only their inputs' shapes (``OpClass.reads_shape_only``)."""


def eligible(info: OpClass) -> bool:
    """Whether an op of class ``info`` may be run again on other values of its inputs."""
    return not (
        info.passthrough or info.is_view or info.is_factory or info.is_random or info.is_collective
        or info.is_host_sync or info.uninitialized_output or info.compiled_region
        or info.short in _DATA_MOVEMENT or info.reads_shape_only
    )
