"""first_nonfinite() finds the op where a NaN or Inf first appears."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import probe
from probe.demo.model import LlamaConfig, TinyLlama, synthetic_batch


class Scale(nn.Module):
    """Multiplies by a factor the test can poison."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_injected_inf_is_found_at_its_op_and_module(tmp_path):
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(num_layers=3))
    poison = Scale()
    model.layers[1].mlp.up_proj = nn.Sequential(model.layers[1].mlp.up_proj, poison)
    opt = torch.optim.AdamW(model.parameters())
    data = torch.Generator().manual_seed(1)
    with probe.mode("stats", out=tmp_path / "r", model=model) as session:
        for step in range(3):
            poison.factor = float("inf") if step == 1 else 1.0
            loss = model.loss(synthetic_batch(model.config, 2, 16, data))
            loss.backward()
            opt.zero_grad()  # keep the weights finite for the next step
            session.step()
    run = probe.load(tmp_path / "r")
    assert run.first_nonfinite(step=0) is None
    bad = run.first_nonfinite()
    assert bad is not None
    assert (bad.step, bad.name, bad.module, bad.phase) == (
        1, "aten.mul.Tensor", "layers.1.mlp.up_proj.1", "forward",
    )
    assert bad.inputs_finite is True
    assert bad.outputs[0].stats["inf"] > 0
    # Everything before it in the step was finite.
    ops = run.ops(1)
    assert all(op.outputs_finite is not False for op in ops[: bad.index])


def test_nan_from_a_backward_op_is_attributed_to_backward(tmp_path):
    torch.manual_seed(0)

    class SqrtNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).clamp(min=0).sqrt()

    model = SqrtNet()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    with probe.mode("stats", out=tmp_path / "r", model=model):
        model(torch.randn(2, 4)).sum().backward()  # d sqrt(x)/dx at 0 is inf
    bad = probe.load(tmp_path / "r").first_nonfinite()
    assert bad is not None and bad.phase == "backward" and bad.module == ""
    assert bad.inputs_finite is True


def test_an_unread_causal_mask_is_no_origin_the_first_overflow_is(tmp_path):
    # nn.TransformerEncoder is given the causal mask and is_causal=True: its attention then calls
    # SDPA with is_causal and never reads the mask's full(-inf). In fp16, layer 1's linear1 grows
    # until its addmm overflows (finite inputs, Inf out): that is where the fault starts.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(torch.float16)
    with torch.no_grad():
        model.layers[1].linear1.weight.mul_(1e5)
    x = torch.randn(2, 8, 32, dtype=torch.float16)
    with probe.mode("stats", out=tmp_path, model=model) as session:
        for _ in range(2):
            mask = nn.Transformer.generate_square_subsequent_mask(8, dtype=torch.float16)
            model(x, mask=mask, is_causal=True).float().square().mean().backward()
            session.step()
    run = probe.load(tmp_path)
    first = run.first_nonfinite()
    assert first is not None
    assert (first.module, first.name, first.step) == ("layers.1.linear1", "aten.addmm.default", 0), first
    assert first.inputs_finite
    for step in run.steps:
        assert all(op.name.split(".")[1] not in ("full", "triu") for op in run.nonfinite_origins(step))


class _MaskedAttention(nn.Module):
    """Causal attention through SDPA with an additive float mask of -inf (read, and absorbed by the
    softmax), then a projection whose output the test can push past float32's largest value."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.overflow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2).contiguous() for t in self.qkv(x).chunk(3, dim=-1))
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        y = self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2))
        return y * 3e38 * 10 if self.overflow else y


def test_a_read_mask_is_no_origin_of_the_nan_a_later_overflow_sends_back(tmp_path):
    # The overflow after the attention makes every gradient NaN; the attention's backward reads
    # that NaN gradient and the mask's -inf, and its NaN outputs are the gradient's: the mask, whose
    # -inf the forward's softmax absorbed, is where no fault starts (it was named first before).
    torch.manual_seed(0)
    model = _MaskedAttention()
    x = torch.randn(2, 6, 16)
    with probe.mode("stats", out=tmp_path, model=model) as session:
        for step in range(2):
            model.overflow = step == 1
            model(x).square().mean().backward()
            session.step()
    run = probe.load(tmp_path)
    assert run.first_nonfinite(step=0) is None
    first = run.first_nonfinite()
    assert first is not None and first.inputs_finite, first
    assert (first.step, first.module, first.name, first.phase) == (1, "", "aten.mul.Tensor", "forward"), first


def test_the_dropped_values_of_a_topk_over_masked_scores_are_no_fault(tmp_path):
    # An indexer masks scores with -inf and keeps topk's indices only (a sparse attention's key
    # selection): the -inf values topk returns beside them are dropped by the program, not a result.
    class Indexer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            scores = h @ x.transpose(-1, -2)
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            picked = scores.topk(4, dim=-1).indices  # the first rows have fewer than 4 keys
            return torch.gather(h, 1, picked[..., :1].expand(-1, -1, h.shape[-1]))

    torch.manual_seed(0)
    model = Indexer()
    with probe.mode("stats", out=tmp_path, model=model) as session:
        model(torch.randn(2, 6, 8)).sum().backward()
        session.step()
    assert probe.load(tmp_path).first_nonfinite() is None


class _PaddedCompressor(nn.Module):
    """DeepSeek-V4's compressor: a buffer padded with -inf, its first rows filled in place, read
    whole by a softmax that turns the padding into zeros; a view of the padding kept and unused."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.padding: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        buffer = h.new_full((2, 8, 8), float("-inf"))
        buffer[:, :4].copy_(h[:, :4])
        self.padding = buffer[:, 4:]  # a view of it, read by no op of the step
        return (buffer.softmax(dim=1) * h.sum(1, keepdim=True)).sum(1)


def test_a_padding_filled_in_part_and_absorbed_is_no_fault(tmp_path):
    # The buffer read whole names the copy_ into its first rows as its source (finite); the -inf
    # is the rest's, made by new_full. Before: the softmax reading it was named as where -inf
    # started, or the unused view, read by no op, as a result holding it.
    torch.manual_seed(0)
    model = _PaddedCompressor()
    poison = Scale()
    with probe.mode("stats", out=tmp_path, model=model) as session:
        for step in range(2):
            poison.factor = float("nan") if step == 1 else 1.0
            (poison(model(torch.randn(2, 6, 8)))).sum().backward()
            session.step()
    run = probe.load(tmp_path)
    assert run.first_nonfinite(step=0) is None
    first = run.first_nonfinite()
    assert first is not None and (first.step, first.name) == (1, "aten.mul.Tensor"), first
