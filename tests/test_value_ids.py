"""The value index (``probe.tracer.value_ids``): what it keeps per value, as the collector sees it."""

from __future__ import annotations

import gc

import torch

from probe.tracer.value_ids import ValueIndex


def test_value_keys_leave_the_collectors_lists_at_the_first_collection():
    # Every traced op registers its results; a key that stays tracked (one holding a torch.Size,
    # a tuple subclass the collector never untracks) is promoted to the oldest generation, whose
    # growth brings on full collections. A key of ints and plain tuples is untracked by the
    # collections it meets (its inner tuples by the first, the key by the next).
    index = ValueIndex()
    a, b = torch.randn(3, 4), torch.randn(5)
    index.register_outputs([a, b], op_index=0, view=False, written=[], rewritten=[])
    gc.collect()
    gc.collect()
    keys = list(index._exact)
    assert len(keys) == 2
    assert not any(gc.is_tracked(key) for key in keys)
    # Still found by a reader's key, which holds the shape as torch gives it (a torch.Size).
    assert [meta[2] for meta in index.describe_inputs([a, b])] == [(0, 0, True), (0, 1, True)]
