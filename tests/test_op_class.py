"""Schema facts per op overload, decided once and cached."""

from __future__ import annotations

import torch

from probe.vocabulary import op_class
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


def test_classes_are_read_once_per_process_and_each_cache_still_hears_of_math_bit_views(monkeypatch):
    # A session per step must not re-read every schema: a second cache (a second tracer) gets
    # the very classes the first one made, without calling classify again.
    first = OpClassCache()
    mm, conj = first[aten.mm.default], first[aten._conj.default]
    calls = []
    monkeypatch.setattr(op_class, "classify", lambda func: calls.append(func) or classify(func))
    heard = []
    second = OpClassCache(on_math_bit_view=lambda: heard.append(True))
    assert second[aten.mm.default] is mm and second.by_id[id(aten.mm.default)] is mm
    assert second[aten._conj.default] is conj and conj.math_bit_view
    assert calls == [] and heard == [True]  # its own tracer must start keying math bits
    monkeypatch.delitem(op_class._CLASSIFIED, aten.sub.Tensor, raising=False)  # never met yet
    assert second[aten.sub.Tensor].name == "aten.sub.Tensor" and calls == [aten.sub.Tensor]
    assert op_class.class_of(aten.mm.default) is mm
    assert mm.mutates is False and classify(aten.add_.Tensor).mutates is True
