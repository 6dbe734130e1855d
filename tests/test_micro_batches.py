"""Gradient accumulation against one full batch (``probe.analysis.micro_batches``): the step of k
micro-batches is folded into the step of one batch and compared op for op (values concatenate,
gradients accumulated into ``.grad`` are compared when done); what each micro-batch has of its own
(its loss, a partial weight gradient) is "not compared" with the reason; a fault in forward,
backward or the optimizer step is found at its module and step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import tiny_llama, zoo_case
from torch import nn

import probe
from probe.analysis.micro_batches import NOT_FOLDED
from probe.analysis.random_draws import draws
from probe.analysis.verdicts import NOT_COMPARED, PASS, WARNING


class Act(nn.Module):
    """GELU, its output scaled by ``factor`` where a test plants a fault (1: not scaled, no op)."""

    factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.gelu(x)
        return y * self.factor if self.factor != 1.0 else y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.act = Act()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.inp(x)))


def _rows_of_8(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)


def _train(out: Path, micro_batches: int, lr: float = 1e-2, steps: int = 2,
           scale: tuple[int, int, float] | None = None, net: Callable[[], nn.Module] = Net,
           draw: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]] = _rows_of_8) -> None:
    """AdamW steps on a batch (``draw``'s: 8 rows), in ``micro_batches`` slices whose gradients
    accumulate (each loss divided by their number, as gradient accumulation does; one batch is not
    sliced). ``scale``: (step, micro-batch, factor), the GELU's output scaled there (a planted fault)."""
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=str(out), model=model) as session:
        for step in range(steps):
            x, y = draw(gen)
            parts = zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True) if micro_batches > 1 \
                else [(x, y)]
            for index, (xs, ys) in enumerate(parts):
                model.act.factor = scale[2] if scale is not None and scale[:2] == (step, index) else 1.0
                (nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
            session.step()


def _rows(report: Any, phase: str) -> list:
    return [c for c in report.comparisons if (c.a or c.b).phase == phase]


def test_two_micro_batches_fold_into_the_full_batch_and_compare_op_for_op(tmp_path):
    _train(tmp_path / "a", 1)
    _train(tmp_path / "b", 2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    forward = [c for c in _rows(report, "forward") if c.a is not None and c.a.module in ("inp", "act", "out")]
    # Every module op of the full batch has the first micro-batch's op as its partner, measured on
    # the micro-batches' values together (the output's shape is the full batch's).
    assert forward and all(c.b is not None and c.verdict in (PASS, WARNING) for c in forward)
    gelu = next(c for c in forward if c.a.name == "aten.gelu.default")
    assert gelu.b.outputs[0].shape == gelu.a.outputs[0].shape == (8, 16)
    assert gelu.outputs[0].metrics and gelu.outputs[0].kind == "stats"
    # The loss is each micro-batch's own: not compared, with the reason.
    loss = next(c for c in _rows(report, "forward") if c.a is not None and "nll_loss_forward" in c.a.name)
    assert loss.verdict == NOT_COMPARED and NOT_FOLDED in loss.message
    # The gradients the optimizer reads are compared where AccumulateGrad made them, when accumulated.
    grads = [c for c in _rows(report, "backward") if c.a is not None and c.a.name == "aten.detach.default"
             and c.a.module in ("inp", "out")]
    assert len(grads) == 8 and all(c.verdict == PASS for c in grads), [(c.a.id, c.message) for c in grads]
    optimizer = _rows(report, "optimizer")
    assert optimizer and all(c.a is not None and c.b is not None and c.verdict in (PASS, WARNING)
                             for c in optimizer)
    assert not report.ok  # what was not compared is never agreement
    assert "not compared" in report.conclusion


@pytest.mark.parametrize("micro_batch", [0, 1])
def test_a_module_scaled_in_one_micro_batch_is_found_at_its_module_and_step(tmp_path, micro_batch):
    _train(tmp_path / "a", 1)
    _train(tmp_path / "b", 2, scale=(1, micro_batch, 1.5))
    d = probe.compare(tmp_path / "a", tmp_path / "b").divergence
    assert d is not None and d.step == 1 and d.op.module == "act", d and (d.step, d.op.id)


def test_the_run_with_micro_batches_may_be_run_a(tmp_path):
    _train(tmp_path / "a", 2)
    _train(tmp_path / "b", 1)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    assert any(c.a is not None and c.a.name == "aten.gelu.default" and c.verdict == PASS
               for c in report.comparisons)
    _train(tmp_path / "c", 1, scale=(0, 0, 2.0))
    d = probe.compare(tmp_path / "a", tmp_path / "c").divergence
    assert d is not None and d.step == 0 and d.op.module == "act"


def test_micro_batches_of_another_count_on_both_sides_are_not_compared(tmp_path):
    # Two against four: neither run holds the full batch the other's values are slices of.
    _train(tmp_path / "a", 2)
    _train(tmp_path / "b", 4)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    micro = [c for c in report.comparisons if (c.a or c.b).phase in ("forward", "backward")]
    assert micro and all(c.verdict == NOT_COMPARED and "micro-batches: 4 calls" in c.message for c in micro)


def test_a_fault_in_the_optimizer_step_of_accumulated_gradients_is_found_there(tmp_path):
    _train(tmp_path / "a", 1)
    _train(tmp_path / "b", 2, lr=1.5e-2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    d = report.divergence
    assert d is not None and d.step == 0 and d.op.phase == "optimizer", report.conclusion


@pytest.mark.parametrize("name", ["llama", "afmoe", "phimoe", "moss_transcribe_diarize", "falcon_mamba"])
def test_a_transformers_model_in_two_micro_batches_compares_clean(name, tmp_path):
    # AFMoE's experts sort the tokens' expert choices: a sort's indices and an arange over the
    # tokens are positions within each micro-batch, no slices of the full batch's positions.
    # PhiMoE's router draws noise (exponential_) in training: each micro-batch draws its own.
    # Moss calls SDPA with dropout_p=0.0: no draw (before: 'propagation' at step 1's rotary backward).
    # FalconMamba's out_proj backward has one `t` more in the micro-batches' step: aligned by name,
    # the weight's `t` went with a `t` of the output gradient ('shape'), a pair dataflow refuses.
    outcome = zoo_case("causal-lm", name, "accumulate-2", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


@pytest.mark.parametrize("name", ["llama", "jetmoe"])
def test_a_fault_in_a_transformers_model_in_micro_batches_is_found_at_its_module_and_step(name, tmp_path):
    # JetMoE's fault sits in an expert: the router's indices, positions within each micro-batch,
    # are not compared, which is no evidence that the routing differs (the zoo's seed: x1.122 at
    # layer 1's experts' input_linear, step 1; before, 'no divergence', every expert op excused).
    outcome = zoo_case("causal-lm", name, "accumulate-2", tmp_path, fault="scale-output")
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.site, outcome.answer)


def _train_llama(out: Path, micro_batches: int, scale_mlp: float = 1.0) -> None:
    """Two AdamW steps of a Llama at hidden 256 on a batch of 4 x 128 tokens (its MLP's activations
    2^20 elements), in ``micro_batches`` slices; ``scale_mlp``: layer 1's MLP output scaled in
    step 1's last micro-batch (a planted fault)."""
    model = tiny_llama(hidden_size=256, intermediate_size=2048, vocab_size=256, max_position_embeddings=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    mlp = model.model.layers[1].mlp
    with probe.mode("stats", out=str(out), model=model) as session:
        for step in range(2):
            ids = torch.randint(0, 256, (4, 128), generator=gen)
            parts = ids.chunk(micro_batches) if micro_batches > 1 else [ids]
            for index, part in enumerate(parts):
                hook = None
                if scale_mlp != 1.0 and step == 1 and index == len(parts) - 1:
                    hook = mlp.down_proj.register_forward_hook(lambda _m, _i, output: output * scale_mlp)
                (model(input_ids=part, labels=part).loss / len(parts)).backward()
                if hook is not None:
                    hook.remove()
            opt.step()
            opt.zero_grad()
            session.step()


def test_at_a_realistic_size_the_fold_is_clean_and_a_fault_in_one_micro_batch_is_found(tmp_path):
    _train_llama(tmp_path / "a", 1)
    _train_llama(tmp_path / "b", 2)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    big = [c for c in report.comparisons if c.a is not None and c.b is not None
           and c.a.outputs and c.a.outputs[0].numel >= 1 << 20 and c.verdict == PASS]
    assert big, "no value of 2^20 elements compared"
    _train_llama(tmp_path / "c", 2, scale_mlp=1.25)
    d = probe.compare(tmp_path / "a", tmp_path / "c").divergence
    assert d is not None and d.step == 1 and d.op.module.startswith("model.layers.1.mlp"), d and d.op.id


class SelfAttention(nn.Module):
    """Two heads of self-attention by SDPA, its dropout probability ``p`` (HF's models pass 0.0)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.qkv, self.p = nn.Linear(16, 48), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p)


class Attention(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.attn, self.out = SelfAttention(p), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x).transpose(1, 2).flatten(2).mean(1))


def _train_attention(out: Path, micro_batches: int, p: float) -> None:
    torch.manual_seed(0)
    model = Attention(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=str(out), model=model) as session:
        for _ in range(2):
            x, y = torch.randn(8, 6, 16, generator=gen), torch.randint(0, 3, (8,), generator=gen)
            for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
                (nn.functional.cross_entropy(model(xs), ys) / micro_batches).backward()
            opt.step()
            opt.zero_grad()
            session.step()


def test_attention_given_dropout_probability_zero_folds_as_any_op(tmp_path):
    # SDPA can draw (its dropout_p), so every micro-batch was taken to draw its own: its results,
    # and everything the attention backward made from them, "not compared" (Moss's accumulation:
    # the rotary backward judged on statistics alone, then 'propagation' at step 1). Given 0.0, as
    # HF's models give it, it draws nothing: its values concatenate like any op's.
    _train_attention(tmp_path / "a", 1, 0.0)
    _train_attention(tmp_path / "b", 2, 0.0)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    attention = [c for c in report.comparisons if c.a is not None and "scaled_dot_product" in c.a.name]
    assert len(attention) == 4, [c.a.id for c in attention]  # forward and backward, two steps
    assert all(c.verdict in (PASS, WARNING) and c.outputs[0].kind == "stats" for c in attention), \
        [(c.a.id, c.message) for c in attention]
    assert attention[0].b.outputs[0].shape == (8, 2, 6, 8)  # the micro-batches' values together


def test_an_op_that_draws_in_each_micro_batch_is_not_compared(tmp_path):
    # Given 0.5, attention's dropout draws in each micro-batch: no slice of the full batch's draw.
    _train_attention(tmp_path / "a", 1, 0.5)
    _train_attention(tmp_path / "b", 2, 0.5)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    drawn = [c for c in report.comparisons if c.a is not None and c.a.module == "attn" and draws(c.a, True)]
    assert drawn, [c.a.name for c in report.comparisons if c.a is not None][:40]
    assert all(c.verdict == NOT_COMPARED and NOT_FOLDED in c.message for c in drawn), \
        [(c.a.id, c.verdict, c.message) for c in drawn]


class TokenNet(nn.Module):
    """A learned token before each sample's rows (a ViT's or AST's CLS token), expanded over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 8))
        self.act = Act()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([self.token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.out(self.act(rows)[:, 0])


def _two_samples(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4, 8, generator=gen), torch.randint(0, 3, (2,), generator=gen)


def test_a_micro_batch_of_one_whose_gradient_becomes_grad_is_folded_as_the_batch_slice(tmp_path):
    # With a micro-batch of one, the token's gradient is the slice of cat's gradient itself (the
    # expand's backward sums nothing), which AccumulateGrad keeps as .grad and the second micro-batch
    # adds into; the full batch slices [2, 1, 8] and sums it. The slice is compared as the batch's
    # slice, not as the accumulated .grad of another shape (before: a "shape" divergence, AST).
    _train(tmp_path / "a", 1, net=TokenNet, draw=_two_samples)
    _train(tmp_path / "b", 2, net=TokenNet, draw=_two_samples)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    _train(tmp_path / "fault", 2, scale=(1, 1, 1.5), net=TokenNet, draw=_two_samples)
    d = probe.compare(tmp_path / "a", tmp_path / "fault").divergence
    assert d is not None and d.step == 1 and d.op.module == "act", d and (d.step, d.op.id)


class Routed(nn.Module):
    """Each sample through one of two experts, an expert called only where a sample is routed to
    it (a mixture's dispatch): how often it is called is its data's, not the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.act = Act()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1).tolist()
        rows = [self.experts[e](x[i:i + 1]) for i, e in enumerate(choice)]
        return self.out(self.act(torch.cat(rows)))


def _routed_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)


def test_the_micro_batches_are_the_model_s_calls_not_its_experts(tmp_path):
    # An expert called only where samples are routed to it is called 1, 2 or 3 times as often with
    # micro-batches (Switch Transformers): the ratio of module calls was not one number, so the
    # step was compared unfolded ('shape' at the embedding). The model's own calls (its root
    # frames) count the micro-batches.
    _train(tmp_path / "a", 1, net=Routed, draw=_routed_batch)
    _train(tmp_path / "b", 2, net=Routed, draw=_routed_batch)
    experts = {op.module_call for op in probe.load(tmp_path / "b").ops(0)
               if op.module == "experts.0" and op.phase == "forward"}
    assert experts, "expert 0 was not called in run B: the test's premise"
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion
    _train(tmp_path / "fault", 2, scale=(1, 0, 1.5), net=Routed, draw=_routed_batch)
    d = probe.compare(tmp_path / "a", tmp_path / "fault").divergence
    assert d is not None and d.step == 1 and d.op.module == "act", d and (d.step, d.op.id)
