"""Alignment by structure (issue 33 item 1): two runs whose module calls decompose otherwise
(a tiny HF Llama with eager attention against the same model with SDPA, fp32) are paired
module call by module call and by dataflow inside a call, never op by op at the same index;
the attention call is a black box judged at its boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

import probe
from probe.analysis.alignment import wrapper_roots
from probe.rundir.run import OpRecord, TensorRecord
from tests.hf_models import tiny_llama, train_steps


def _train(out: Path, attn: str, scale_layer: int | None = None) -> None:
    model = tiny_llama(attn_implementation=attn)
    if scale_layer is not None:  # a bug inside the black box: the attention's output x 1.5
        attention = model.model.layers[scale_layer].self_attn
        forward = attention.forward

        def scaled(*args: object, **kwargs: object) -> tuple:
            out = forward(*args, **kwargs)
            return (out[0] * 1.5, *out[1:])

        attention.forward = scaled
    with probe.mode("stats", out=out, model=model) as session:
        train_steps(model, session, steps=2)


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("alignment") / "eager"
    _train(out, "eager")
    return out


def test_eager_and_sdpa_attention_compare_clean_and_no_op_is_paired_across_decompositions(
        tmp_path: Path, eager_run: Path) -> None:
    _train(tmp_path / "sdpa", "sdpa")
    report = probe.compare(eager_run, tmp_path / "sdpa")
    assert report.divergence is None, report.conclusion
    assert report.conclusion.startswith("no divergence"), report.conclusion
    # Before: a view of the eager decomposition was paired with SDPA's view of another shape.
    paired = [c for c in report.comparisons if c.a is not None and c.b is not None]
    assert all([t.shape for t in c.a.outputs] == [t.shape for t in c.b.outputs] for c in paired)
    sdpa = [c for c in report.comparisons if c.a is None and "scaled_dot_product" in c.b.name]
    assert sdpa and all(c.verdict == "unmatched" for c in sdpa)
    # What follows the box (o_proj, reading the attention's output) is paired and compared.
    o_proj = [c for c in paired if c.a.module == "model.layers.0.self_attn.o_proj" and c.a.phase == "forward"]
    assert o_proj and all(c.verdict == "pass" for c in o_proj)


def test_a_fault_inside_the_black_box_is_found_at_its_module_and_step(tmp_path: Path,
                                                                     eager_run: Path) -> None:
    _train(tmp_path / "sdpa", "sdpa", scale_layer=1)
    report = probe.compare(eager_run, tmp_path / "sdpa")
    d = report.divergence
    assert d is not None and d.step == 0, report.conclusion
    assert d.op.module.startswith("model.layers.1.self_attn"), report.conclusion


def _op(index: int, stack: list[str]) -> OpRecord:
    module = stack[-1].rpartition("[")[0] if stack else ""
    return OpRecord(index, f"forward:{stack[-1] if stack else ''}:aten.relu.default:0", "aten.relu.default",
                    "forward", module, 0, stack, 0, 0, [TensorRecord("float32", (2,))],
                    [TensorRecord("float32", (2,))])


def test_a_wrapper_called_around_the_model_in_one_run_is_its_root() -> None:
    eager = [_op(0, ["[0]"]), _op(1, ["[0]", "conv1[0]"])]
    compiled = [_op(0, ["OptimizedModule[0]"]), _op(1, ["OptimizedModule[0]", "conv1[0]"])]
    assert wrapper_roots(eager, compiled) == {"OptimizedModule": ""}
    assert wrapper_roots(compiled, eager) == {"": "OptimizedModule"}
    assert wrapper_roots(eager, eager) == {}
