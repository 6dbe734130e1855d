"""Schema facts per op overload, decided once and cached."""

from __future__ import annotations

import torch

from probe.vocabulary.op_class import OpClassCache, classify

aten = torch.ops.aten


def test_schema_facts():
    add_ = classify(aten.add_.Tensor)
    assert add_.is_inplace and add_.mutated_args == (0,) and not add_.is_view
    out = classify(aten.add.out)
    assert out.is_out and out.mutated_kwargs == ("out",) and not out.is_inplace
    view = classify(aten.view.default)
    assert view.is_view and not view.mutates
    assert classify(aten.ones.default).is_factory
    assert classify(aten.bernoulli.default).is_random
    assert not classify(aten.mm.default).is_random
    assert classify(aten._local_scalar_dense.default).is_host_sync
    assert classify(aten.empty.memory_format).uninitialized_output
    assert classify(aten.sym_size.int).passthrough
    foreach = classify(aten._foreach_add_.Scalar)
    assert foreach.mutated_args == (0,)
    assert classify(aten.mm.default).name == "aten.mm.default"
    assert classify(aten.mm.default).short == "mm"


def test_cache_classifies_once_and_handles_higher_order_ops():
    cache = OpClassCache()
    first = cache[aten.mm.default]
    assert cache[aten.mm.default] is first
    cond = cache[torch.ops.higher_order.cond]
    assert cond.name == "hop.cond" and cond.namespace == "hop" and not cond.passthrough
