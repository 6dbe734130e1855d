"""``probe compare`` as a detector, on cases of the generated matrix of ``benchmarks.diagnosis``
one step outside the shapes the older tests used: Hugging Face's defaults (SDPA attention,
real vocabularies, several optimizer steps), other precision policies (fp16 autocast with a
GradScaler, a bf16 model, another thread count) and faults planted in the exact regime.

Each case trains a transformers model from a config (random weights) twice under the stats
mode, a reference run A in fp32 and a run B, and compares them. The whole matrix is the
benchmark (``python -m benchmarks.diagnosis``); these are the cases CI keeps an eye on."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from benchmarks.diagnosis import Case, Outcome, run_case


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Runs cases sharing their reference runs A (one per model, vocabulary and steps)."""
    root = tmp_path_factory.mktemp("diagnosis")
    references: dict[Case, Path] = {}

    def run(case: Case) -> Outcome:
        return run_case(case, root, references)
    return run


HEALTHY = [
    # Hugging Face's default attention (SDPA) under bf16 autocast, over two AdamW steps.
    Case("llama", "sdpa", 256, 2, "adamw", ("stats",), "bf16-autocast"),
    # A real vocabulary: the embedding gradient is copied into an uninitialized buffer.
    Case("llama", "eager", 1024, 2, "adamw", ("stats",), "bf16-autocast"),
    # fp16 autocast with a GradScaler against fp32 without one: the scale divided out.
    Case("llama", "sdpa", 256, 2, "adamw", ("stats",), "fp16-autocast"),
    Case("llama", "sdpa", 256, 2, "adamw", ("stats",), "bf16-model"),
    # One thread against two: reductions in another order, and statistics summed in another.
    Case("llama", "eager", 1024, 2, "adamw", ("stats",), "threads-1"),
    # Other families: learned positions and Conv1D projections; a partial rotary.
    Case("gpt2", "sdpa", 256, 2, "adamw", ("stats",), "bf16-autocast"),
    Case("phi", "sdpa", 256, 2, "adamw", ("stats",), "fp16-autocast"),
    # SGD with momentum updates the embedding's rows of the tokens seen only: by step 2 the
    # table's difference, small over the whole table, sits in the rows the embedding selects.
    Case("phi", "sdpa", 1024, 3, "sgd", ("stats",), "bf16-autocast"),
    # The same for GPT-2's learned positions: a table of 64 rows, 16 of them selected.
    Case("gpt2", "sdpa", 1024, 3, "sgd", ("stats",), "fp16-autocast"),
    # A bf16 layer norm's weight gradient sums over the rows (34 here): its replay bound grows
    # with that length, not with the normalized size's.
    Case("vit", "eager", None, 1, "sgd", ("stats", "dump"), "bf16-model"),
    # T5's norm weight gradient at step 2 sums a product over 32 rows: the product's elements
    # differ by its inputs' difference (fp16 rounding of random sign), which its statistics
    # average away and the sum makes visible.
    Case("t5", "eager", 256, 3, "sgd", ("stats",), "fp16-autocast"),
]


@pytest.mark.parametrize("case", HEALTHY, ids=[c.label for c in HEALTHY])
def test_a_healthy_pair_is_no_divergence(matrix, case):
    outcome = matrix(case)
    assert outcome.error is None, outcome.error
    assert outcome.found is False, outcome.answer
    assert outcome.conclusion.startswith("no divergence"), outcome.conclusion


FAULTS = [
    # A weight element changed before the second step, in an fp32 pair: the runs computed alike
    # bit for bit through step 0, so the weight's own difference is where it enters.
    (Case("llama", "sdpa", 256, 2, "adamw", ("stats",), "fp32", "weight_corrupt"), None),
    (Case("qwen2", "eager", 1024, 2, "sgd", ("stats",), "fp32", "eps_removed"), None),
    # With dumps the re-implemented norm's ops match run A's: its add of eps (now 0.0) reads
    # identical tensors and differs by about 1e-6, below any rounding floor: called otherwise.
    (Case("mistral", "eager", 1024, 1, "adamw", ("stats", "dump"), "fp32", "eps_removed"), "arguments"),
    # A norm computed in bf16 inside a bf16 autocast run: behind SDPA's casts, not hidden by them.
    (Case("llama", "sdpa", 256, 2, "adamw", ("stats",), "bf16-autocast", "norm_bf16"), None),
    (Case("mistral", "sdpa", 1024, 2, "adamw", ("stats",), "bf16-autocast", "rotary_bf16"), None),
    # A mask moved by one key in run B's re-implemented attention: statistics of the scores and
    # weights cannot see a permutation, but the re-implementation's own forward ops (its
    # repeat_interleave of keys and values) carry the difference into the matched products.
    (Case("phi", "eager", 1024, 1, "adamw", ("stats",), "bf16-autocast", "mask_shift"), "unmatched producer"),
]


@pytest.mark.parametrize("case, rule", FAULTS, ids=[c.label for c, _ in FAULTS])
def test_a_planted_fault_is_named_at_its_module_and_step(matrix, case, rule):
    outcome = matrix(case)
    assert outcome.error is None, outcome.error
    assert outcome.found, f"expected {outcome.expected}, got {outcome.answer}"
    if rule is not None:
        assert f"({rule})" in outcome.answer
