"""probe compare reports first whether the runs started alike (weights, inputs, RNG) and what differs
in their environments; a different start is the conclusion's explanation, not the first dropout."""

from __future__ import annotations

import csv
import json
import random

import numpy as np
import pytest
import torch
from hf_models import tiny_llama

import probe
from probe.cli import main as cli_main

pytest.importorskip("transformers", reason="transformers is an optional test dependency")
pytestmark = pytest.mark.slow  # six two-step training runs, shared by the module


def _run(out, init_seed=0, dropout_seed=1, model_given=True, data_seed=5, dropout=0.2, host_seed=None,
         fault=False, bf16_inv_freq=False, **options):
    """Two training steps of a tiny Llama with attention dropout: weights from ``init_seed``,
    dropout masks from ``dropout_seed``; ``host_seed`` seeds Python's and NumPy's generators
    (nothing draws from them); ``fault`` plants a bug: layer 1's MLP output x1.01;
    ``bf16_inv_freq`` rounds the rotary embedding's ``inv_freq`` buffer through bf16."""
    model = tiny_llama(seed=init_seed, attention_dropout=dropout)
    model.train()
    if fault:
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 1.01)
    if bf16_inv_freq:
        inv_freq = model.model.rotary_emb.inv_freq
        inv_freq.copy_(inv_freq.to(torch.bfloat16).float())
    torch.manual_seed(dropout_seed)
    host_states = random.getstate(), np.random.get_state()
    if host_seed is not None:
        random.seed(host_seed)
        np.random.seed(host_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(data_seed))
    with probe.mode("stats", out=out, model=model if model_given else None, **options) as session:
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    random.setstate(host_states[0])  # the other runs of this module start from the same ones
    np.random.set_state(host_states[1])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    return {
        "a": _run(root / "a", hparams={"lr": 1e-3, "batch": 2}),
        "same": _run(root / "same", hparams={"lr": 1e-3, "batch": 2}),
        "init": _run(root / "init", init_seed=1, hparams={"lr": 2e-3, "batch": 2}),
        "dropout": _run(root / "dropout", dropout_seed=2),
        "data": _run(root / "data", data_seed=6),
        "unrecorded": _run(root / "unrecorded", model_given=False),
    }


def test_the_same_seed_starts_alike_and_says_so(runs):
    report = probe.compare(runs["a"], runs["same"])
    identity = report.identity
    assert [(c.what, c.status) for c in identity.checks] == [("weights", "same"), ("inputs", "same"),
                                                             ("rng", "same")]
    assert identity.started_alike is True and identity.differences == []
    assert identity.conclusion.startswith("the runs started alike: same initial weights at step 0")
    assert report.first_divergence is None
    assert report.conclusion == "no divergence: every matched op compared clean"
    assert report.summary["identity"]["started_alike"] is True


def test_other_initial_weights_are_named_as_the_explanation(runs):
    report = probe.compare(runs["a"], runs["init"])
    weights = report.identity.check("weights")
    assert weights.status == "differ" and weights.step == 0
    assert "model.layers.0.self_attn.q_proj.weight" in weights.names
    assert "model.norm.weight" not in weights.names  # ones in both runs: the same bits
    assert report.identity.check("rng").status == "same"
    assert report.first_divergence is not None  # the ops differ, and the start says why
    assert report.conclusion.startswith("the runs did not start alike: initial weights differ at step 0 (")
    assert "that explains the differences downstream (first divergence at" in report.conclusion
    described = [d.describe() for d in report.identity.differences]
    assert described == ["hparam lr: 0.001 in run A, 0.002 in run B"]


def test_another_dropout_seed_names_the_rng_not_the_first_dropout(runs):
    report = probe.compare(runs["a"], runs["dropout"])
    identity = report.identity
    assert identity.check("weights").status == "same" and identity.check("inputs").status == "same"
    rng = identity.check("rng")
    assert rng.status == "differ" and rng.step == 0 and rng.names == ["torch"]
    # The ops' first divergence is the first dropout mask; the conclusion leads with its cause.
    assert any(word in report.divergence.op.name for word in ("dropout", "bernoulli"))
    assert report.conclusion.startswith("the runs did not start alike: RNG state differs at step 0 "
                                        "(torch CPU generator); that explains the differences downstream")
    assert report.summary["conclusion"] == report.conclusion


def test_a_bug_is_the_conclusion_when_only_generators_the_ops_never_draw_from_differ(tmp_path):
    # Python's and NumPy's generators differ (every process seeds them its own way), and a real
    # bug runs in B: the bug is the conclusion, not "the runs did not start alike".
    a = _run(tmp_path / "a", host_seed=1)
    b = _run(tmp_path / "b", host_seed=2, fault=True)
    report = probe.compare(a, b)
    rng = report.identity.check("rng")
    assert rng.status == "differ" and sorted(rng.names) == ["numpy", "python"] and rng.torch_step is None
    assert report.identity.started_alike is False  # said, as it is
    op = report.divergence.op  # the hook's x1.01, run as layers.1 takes the MLP's output
    assert (op.name, op.module) == ("aten.mul.Tensor", "model.layers.1")
    assert report.conclusion.startswith("first divergence at ")
    assert report.conclusion.endswith("(the runs' RNG state differs at step 0 (NumPy global generator, "
                                      "Python random): torch's ops do not draw from Python's or NumPy's "
                                      "generators)")


def test_a_torch_generator_no_op_draws_from_does_not_explain_a_bug(tmp_path):
    a = _run(tmp_path / "a", dropout=0.0, dropout_seed=1)
    b = _run(tmp_path / "b", dropout=0.0, dropout_seed=2, fault=True)
    report = probe.compare(a, b)
    rng = report.identity.check("rng")
    assert rng.names == ["torch"] and rng.torch_step == 0
    op = report.divergence.op  # the hook's x1.01, run as layers.1 takes the MLP's output
    assert (op.name, op.module) == ("aten.mul.Tensor", "model.layers.1")
    assert report.conclusion.startswith("first divergence at ")
    assert report.conclusion.endswith("(torch CPU generator): no compared op draws random numbers)")


def test_other_data_is_named(runs):
    inputs = probe.compare(runs["a"], runs["data"]).identity.check("inputs")
    assert inputs.status == "differ" and inputs.step == 0 and inputs.names == ["input_ids", "labels"]


def test_a_run_without_checksums_is_not_recorded_never_a_pass(runs):
    report = probe.compare(runs["a"], runs["unrecorded"])
    identity = report.identity
    assert {c.status for c in identity.checks} == {"not recorded"}
    assert "run B recorded none" in identity.check("weights").message
    assert identity.started_alike is None
    assert identity.conclusion.startswith("whether the runs started alike is not known")
    assert report.conclusion == "no divergence: every matched op compared clean"  # the ops still agree


def test_environment_differences_are_listed(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    other = _run(tmp_path / "b", hparams={"lr": 1e-3, "batch": 4})
    identity = probe.compare(runs["a"], other).identity
    described = [d.describe() for d in identity.differences]
    assert "variable NCCL_ALGO: unset in run A, 'Ring' in run B" in described
    assert "hparam batch: 2 in run A, 4 in run B" in described
    assert identity.started_alike is True  # the same start in another environment
    assert "their environments differ (" in identity.conclusion


def test_identity_in_json_csv_and_console(runs, tmp_path, capsys):
    assert cli_main(["compare", str(runs["a"]), str(runs["dropout"]), "-o", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "rng: differ" in shown and "the runs did not start alike: RNG state differs" in shown
    summary = json.loads((tmp_path / "out" / "report.json").read_text())
    checks = {c["what"]: c for c in summary["identity"]["checks"]}
    assert checks["rng"]["status"] == "differ" and checks["weights"]["status"] == "same"
    with open(tmp_path / "out" / "identity.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["Kind"], r["Status"]) for r in rows] == [("weights", "same"), ("inputs", "same"),
                                                       ("rng", "differ")]
    assert "RNG state differs" in (tmp_path / "out" / "report.html").read_text()


def test_a_changed_buffer_is_named_and_explains_the_divergence(runs, tmp_path):
    # inv_freq is a non-persistent buffer: not a parameter, not in the state dict, and it turns
    # every attention's rotation. Rounded through bf16 in run B, the start differs there.
    report = probe.compare(runs["a"], _run(tmp_path / "b", bf16_inv_freq=True))
    weights = report.identity.check("weights")
    assert weights.status == "differ" and weights.step == 0
    assert weights.names == ["model.rotary_emb.inv_freq"]  # every parameter is the same
    assert weights.message == ("initial buffers differ at step 0 (buffer model.rotary_emb.inv_freq "
                               "differs)")
    assert report.identity.started_alike is False
    assert report.first_divergence is not None
    assert report.conclusion.startswith("the runs did not start alike: initial buffers differ at step 0 "
                                        "(buffer model.rotary_emb.inv_freq differs); that explains the "
                                        "differences downstream (first divergence at")


def test_the_same_buffers_are_counted_and_old_runs_compare_their_parameters(runs, tmp_path):
    weights = probe.compare(runs["a"], runs["same"]).identity.check("weights")
    assert weights.message == "same initial weights at step 0 (21 parameters, 2 buffers)"
    # A run written before buffers were recorded: its checksums.json has no "buffers".
    import shutil

    old = tmp_path / "old"
    shutil.copytree(runs["same"], old)
    for path in old.rglob("checksums.json"):
        data = json.loads(path.read_text())
        data.pop("buffers", None)
        path.write_text(json.dumps(data))
    identity = probe.compare(runs["a"], old).identity
    assert identity.check("weights").status == "same" and identity.started_alike is True
    assert identity.check("weights").message == "same initial weights at step 0 (21 parameters)"
    assert identity.notes == ["run B recorded no buffers (written by an older probe): the weights are "
                              "compared on their parameters only"]
