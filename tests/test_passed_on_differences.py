"""A difference of random sign (rounding's) that statistics average away: an op whose result picks
other elements than its inputs' extremes (a product by another tensor, a sum) counts, for an
input known by statistics, the differences its producers carried, through producers that passed on
their statistics (and were so never judged from their inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from hf_models import zoo_case


def test_a_norm_backward_product_past_a_passed_gradient_sum_is_rounding(tmp_path: Path):
    # OLMoE with eager attention against its default SDPA: the query path's input gradient differs
    # by 3e-7 (another attention backward), the sum with the key and value paths' passes on its
    # statistics (5e-9 apart), and the input norm's backward multiplies it by the normalised input:
    # its extremes, other elements, 1.2e-6 apart. Before: 'propagation' at that `mul`, step 0, bound
    # 32 x 5e-9 + rounding 9.5e-7.
    outcome = zoo_case("causal-lm", "olmoe", "eager-attention", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_an_activation_backward_is_a_product_by_another_tensor(tmp_path: Path):
    # Lara-mini's experts in two micro-batches against one batch, step 1: the weights differ by
    # the first step's rounding in another order, and silu_backward multiplies the experts'
    # gradient by SiLU's derivative at the gate's output, element by element, like a `mul`. Its
    # inputs' statistics (folded from the micro-batches: no sketches) are 2.2e-7 apart, its
    # result's 1.2e-5. Before: 'propagation' at silu_backward, bound 32 x 2.2e-7 + rounding.
    outcome = zoo_case("causal-lm", "lara_mini", "accumulate-2", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)
