"""The free benchmark's bits rule: an output that keeps fewer than 4 significant bits given its
inputs' rounding fails (a cancellation), an ill-conditioned but healthy op does not (fp32 sin of
large arguments), and healthy HF models in bf16 and fp16 stay at <= 1% failed checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from torch import nn

import probe

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

DEFAULT = None  # the mode's default perturbation (improve_precision)


class CancellingMLP(nn.Module):
    """An MLP whose hidden activations are shifted by 1e4 and back: in bf16 nothing is left of them."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        hidden = (hidden + 1e4) - 1e4
        return self.down(torch.relu(hidden))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), CancellingMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _options(perturb: str | None) -> dict[str, str]:
    return {} if perturb is None else {"perturb": perturb}


@pytest.mark.parametrize("perturb", [DEFAULT, "add_noise"])
def test_a_total_cancellation_in_bf16_fails_and_names_the_subtraction_and_its_module(tmp_path, perturb):
    torch.manual_seed(0)
    model = Block().bfloat16()
    x = torch.randn(4, 8, 16).bfloat16()
    with torch.no_grad():
        hidden = model.mlp.up(model.norm(x))
        assert not ((hidden + 1e4) - 1e4).any()  # the original output is all zero: nothing kept
    with probe.mode("free_benchmark", out=tmp_path / "r", model=model, **_options(perturb)):
        model(x).float().pow(2).mean().backward()
    checks = probe.load(tmp_path / "r").checks()
    failed = [c for c in checks if c.verdict == "fail" and c.phase == "forward"]
    assert [(c.name, c.module) for c in failed] == [("aten.sub.Tensor", "mlp")]
    (sub,) = failed
    assert sub.ratio > 10 * sub.threshold and "rule bits: keeps 0." in sub.reason  # of 8 bits, none left
    # The add before it rounds 1e4 + h as bf16 must; it is not where the bits are lost.
    adds = [c for c in checks if c.name == "aten.add.Tensor" and c.module == "mlp" and c.phase == "forward"]
    assert adds and all(c.verdict == "pass" for c in adds)


@pytest.mark.parametrize("perturb", [DEFAULT, "add_noise"])
def test_fp32_sin_and_cos_of_large_arguments_keep_enough_bits_and_pass(tmp_path, perturb):
    # One fp32 ULP of 1e4 is 1e-3: sin keeps about ten bits, the rotary embeddings' case.
    x = torch.empty(4096).uniform_(1e3, 1e4, generator=torch.Generator().manual_seed(0))
    with probe.mode("free_benchmark", out=tmp_path / "r", **_options(perturb)):
        x.sin()
        x.cos()
    checks = probe.load(tmp_path / "r").checks()
    assert [c.name for c in checks] == ["aten.sin.default", "aten.cos.default"]
    assert all(c.verdict == "pass" for c in checks), [(c.name, c.ratio, c.reason) for c in checks]
    assert all(1e-4 < c.ratio < c.threshold for c in checks)  # measured, not zero


@pytest.mark.parametrize("perturb", [DEFAULT, "add_noise"])
def test_an_exactly_zero_output_that_stays_zero_passes(tmp_path, perturb):
    x = torch.randn(64, generator=torch.Generator().manual_seed(0)).bfloat16() + 1e4
    with probe.mode("free_benchmark", out=tmp_path / "r", **_options(perturb)):
        x - x
    (check,) = probe.load(tmp_path / "r").checks()
    assert check.verdict == "pass" and check.ratio == 0


def _llama() -> nn.Module:
    return tiny_llama(seed=None, hidden_size=64, intermediate_size=128, max_position_embeddings=256)


def _gpt2() -> nn.Module:
    return tiny_gpt2(seed=None, n_embd=64, n_positions=256, bos_token_id=0, eos_token_id=0)


@pytest.mark.parametrize("perturb", [DEFAULT, "add_noise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_healthy_hf_models_have_at_most_one_percent_failed_checks(tmp_path, build, dtype, perturb):
    torch.manual_seed(0)
    model = build().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    with probe.mode("free_benchmark", out=tmp_path / "r", model=model, **_options(perturb)) as session:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        session.step()
    checks = probe.load(tmp_path / "r").checks()
    counts = Counter(c.verdict for c in checks)
    judged = counts["pass"] + counts["fail"]
    assert judged > 200 and {c.phase for c in checks} >= {"forward", "backward", "optimizer"}
    if build is _llama:  # the rotary embeddings' fp32 cos and sin are among the checks
        assert {"aten.cos.default", "aten.sin.default"} <= {c.name for c in checks if c.dtype == "float32"}
    failed = [(c.op_id, c.module, c.reason) for c in checks if c.verdict == "fail"]
    assert counts["fail"] <= 0.01 * judged, failed


@pytest.mark.parametrize("perturb", [DEFAULT, "add_noise"])
def test_a_softmax_blind_to_a_shift_still_fails_on_fp16_logits_near_1000(tmp_path, perturb):
    # One fp16 ULP at 1000 is 0.5: the rounding of the logits alone puts the softmax 7.5% from
    # exact. Inputs moved all one way shift as one, and a softmax ignores a shift: the
    # perturbation must move elements relative to each other for this to show.
    logits = (1000 + torch.randn(8, 64, generator=torch.Generator().manual_seed(0))).half()
    exact = torch.softmax(1000 + torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).double(), -1)
    assert float(((torch.softmax(logits.float(), -1) - exact).abs() / exact).max()) > 0.05
    with probe.mode("free_benchmark", out=tmp_path / "r", **_options(perturb)):
        torch.softmax(logits, -1)
    (check,) = probe.load(tmp_path / "r").checks()
    assert check.verdict == "fail" and "rule bits" in check.reason, (check.ratio, check.reason)
