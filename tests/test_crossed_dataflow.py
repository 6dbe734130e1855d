"""Two decompositions of one module call (SDPA against eager attention) are not paired op by op:
their ops of the same name and index are other values, and a healthy pair compares clean; the
attention is judged at its boundary, so a fault inside it is still named there."""

from __future__ import annotations

import pytest
import torch

import probe

pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from hf_models import tiny_llama

ATTN = "model.layers.1.self_attn"


def _run(out, attn: str, scale_attention: float | None = None):
    """A tiny Llama, fp32, two AdamW steps under the stats mode."""
    model = tiny_llama(hidden_size=64, intermediate_size=128, attn_implementation=attn)
    if scale_attention is not None:  # inside the module call, as the zoo's scale-output plants it
        attention = model.get_submodule(ATTN)
        forward = attention.forward

        def scaled(*args, **kwargs):
            output = forward(*args, **kwargs)
            return (output[0] * scale_attention, *output[1:])
        attention.forward = scaled
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=str(out), model=model) as session:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


@pytest.fixture(scope="module")
def sdpa_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("sdpa"), "sdpa")


def test_sdpa_against_eager_attention_is_no_divergence(sdpa_run, tmp_path):
    """Before, the n-th view of SDPA's attention was paired with the n-th view of eager's (another
    value, another shape): 'shape' at the first layer's self_attn view, step 0."""
    report = probe.compare(sdpa_run, _run(tmp_path / "eager", "eager"))
    assert report.divergence is None, report.conclusion
    # The differing parts are unpaired on both sides, never compared across decompositions.
    attention = [c for c in report.comparisons if c.a is not None and c.b is not None
                 and c.a.module == ATTN and c.a.phase == "forward"]
    assert attention and all(c.a.name == c.b.name for c in attention)
    assert all(c.a.outputs[0].shape == c.b.outputs[0].shape for c in attention)
    assert any(c.a is not None and c.b is None and "scaled_dot_product" in c.a.name
               for c in report.comparisons)


def test_a_fault_inside_the_black_box_is_named_at_its_module(sdpa_run, tmp_path):
    report = probe.compare(sdpa_run, _run(tmp_path / "eager", "eager", scale_attention=1.05))
    d = report.divergence
    assert d is not None, report.conclusion
    assert d.step == 0 and d.op.module == ATTN, (d.op.id, d.rule, d.comparison.message)
