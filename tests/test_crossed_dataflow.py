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


def _shifted_mask_attention(per_head: bool):
    """An attention function of one's own (registered with transformers) whose mask is moved by
    one key position: its mask fill is ``finfo.min`` of the scores' dtype, and ``per_head`` writes
    it as a loop over batch rows and heads, as hand-written re-implementations do (a long black
    box: one matmul, scale, fill, softmax and matmul per head)."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        n = query.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool).tril().roll(1, dims=-1)

        def one(q, k, v):
            scores = (q @ k.transpose(-1, -2)) * scaling
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

        if per_head:
            out = torch.stack([torch.stack([one(query[b, h], key[b, h], value[b, h])
                                            for h in range(query.shape[1])]) for b in range(query.shape[0])])
        else:
            out = one(query, key, value)
        return out.transpose(1, 2).contiguous(), None

    return attend


def _run_shifted(out, per_head: bool, autocast: torch.dtype | None):
    import transformers

    name = f"probe_test_shifted_{'per_head' if per_head else 'batched'}"
    transformers.AttentionInterface.register(name, _shifted_mask_attention(per_head))
    model = tiny_llama(hidden_size=64, intermediate_size=128, attn_implementation="sdpa")
    attention = model.get_submodule(ATTN)
    attention.config = type(attention.config)(**attention.config.to_dict())
    attention.config._attn_implementation_internal = name  # this layer only
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=str(out), model=model) as session:
        for _ in range(2):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


@pytest.mark.parametrize("per_head, autocast", [(True, None), (False, torch.float16)],
                         ids=["per-head-loop-fp32", "fp16-autocast"])
def test_a_mask_moved_by_one_key_in_a_reimplemented_attention_is_named_there(sdpa_run, tmp_path,
                                                                               per_head, autocast):
    """Before: a black box of over 64 ops was 'too long to bound' and passed unjudged (the per-head
    loop: named only by the shape rule at a backward view); fp16's mask fill (-65504) was taken
    for a logit, so the softmax's estimated amplification (2 x 65504) excused any difference
    (none found)."""
    report = probe.compare(sdpa_run, _run_shifted(tmp_path / "b", per_head, autocast))
    d = report.divergence
    assert d is not None, report.conclusion
    # In the forward, where the attention's output first differs (not at a backward view paired
    # with another of another shape, as the per-head loop was named before).
    assert (d.step, d.op.module, d.op.phase) == (0, ATTN, "forward"), (d.op.id, d.rule, d.comparison.message)


class _Rotary(torch.nn.Module):
    """cos and sin of the positions, made in a module call of their own and read by the attention."""

    def __init__(self, dim: int):
        super().__init__()
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(n).float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[None, None]
        return angles.cos(), angles.sin()


class _RotaryAttention(torch.nn.Module):
    """Rotary attention with a norm of q and k after the rotation (a QK-norm), eager or SDPA."""

    def __init__(self, width: int, heads: int, eager: bool):
        super().__init__()
        self.heads, self.eager = heads, eager
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.q_norm, self.k_norm = torch.nn.RMSNorm(width // heads), torch.nn.RMSNorm(width // heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))

        def rotate(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        q, k = self.q_norm(rotate(q)), self.k_norm(rotate(k))
        if self.eager:  # the scaling's `mul` in backward is one run's only: it shifts the ids of `mul`
            y = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1) @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, w))


class _RotaryModel(torch.nn.Module):
    def __init__(self, eager: bool, vocab: int = 64, width: int = 32, heads: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.rotary = _Rotary(width // heads)
        self.attn = _RotaryAttention(width, heads, eager)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.attn(x, *self.rotary(ids.shape[1])))


def _train_tokens(out, model: torch.nn.Module):
    """``model`` (tokens to logits over 64), two AdamW steps under the stats mode."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=str(out), model=model) as session:
        for _ in range(2):
            torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


def _run_rotary(out, eager: bool):
    torch.manual_seed(0)
    return _train_tokens(out, _RotaryModel(eager))


def test_a_pair_reading_other_values_made_in_another_module_call_is_refused(tmp_path):
    """Eager attention's backward has one `mul` more (its scaling) than SDPA's, so by id the rotary
    product of a gradient by cos in one run was paired with the product by sin in the other: both
    read values of the rotary module's call, which the dataflow check skipped as another call's
    boundary (nanochat, moss_transcribe_diarize in the zoo: 'propagation' at such a `mul`)."""
    report = probe.compare(_run_rotary(tmp_path / "sdpa", False), _run_rotary(tmp_path / "eager", True))
    assert report.divergence is None, report.conclusion
    pairs = {c.a.index: c.b.index for c in report.steps[0].comparisons if c.a is not None and c.b is not None}
    for c in report.steps[0].comparisons:
        if c.a is None or c.b is None:
            continue
        for ta, tb in zip(c.a.inputs, c.b.inputs, strict=False):
            if ta.source is not None and tb.source is not None and ta.source[0] in pairs:
                # A paired input is read from its partner: no product by cos against one by sin.
                assert pairs[ta.source[0]] == tb.source[0] or tb.source[0] not in pairs.values(), \
                    (c.a.id, c.b.id, ta.source, tb.source)


class _MaskedAttention(torch.nn.Module):
    """Attention whose value head is narrower than its query and key heads (as multi-head latent
    attention's), so that SDPA takes its math path on the CPU: it scales q and k by
    ``sqrt(scale)`` each, where eager attention scales the scores."""

    def __init__(self, width: int, heads: int, eager: bool, factor: float):
        super().__init__()
        self.heads, self.eager, self.factor = heads, eager, factor
        self.qkv, self.out = torch.nn.Linear(width, 5 * width // 2), torch.nn.Linear(width // 2, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        mask = mask.select(1, 0).unsqueeze(1)  # read in either kind: booleans or additive floats
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).split((w, w, w // 2), dim=-1))
        if self.eager:
            y = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask).softmax(-1) @ v
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, w // 2) * self.factor)


class _MaskedModel(torch.nn.Module):
    """The mask made once for the layers, as transformers does: booleans for SDPA, an additive
    float mask (`where` of them) for eager attention."""

    def __init__(self, eager: bool, factor: float, vocab: int = 64, width: int = 32, heads: int = 2):
        super().__init__()
        self.eager = eager
        self.embed = torch.nn.Embedding(vocab, width)
        self.attn = _MaskedAttention(width, heads, eager, factor)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(ids.shape[0], 1, n, n)
        mask = torch.where(keep, 0.0, torch.finfo(torch.float32).min) if self.eager else keep
        x = self.embed(ids)
        return self.head(x + self.attn(x, mask))


def _run_masked(out, eager: bool, factor: float = 1.0):
    torch.manual_seed(0)
    return _train_tokens(out, _MaskedModel(eager, factor))


def test_sdpa_math_path_against_eager_attention_is_no_divergence(tmp_path):
    """Before: 'shape' at the `select` of the mask (bool against float32), and without it
    'unmatched producer' at SDPA's `mul.Scalar` of q (0.5 apart: sqrt(scale) placed on q and k,
    where eager attention scales the scores; deepseek_v32, doge, falcon in the zoo)."""
    report = probe.compare(_run_masked(tmp_path / "sdpa", False), _run_masked(tmp_path / "eager", True))
    assert report.divergence is None, report.conclusion
    # SDPA's scaled q and k are in the box: never compared with eager's unscaled ones.
    assert not any(c.a is not None and c.b is not None and c.a.module == "attn" and c.a.phase == "forward"
                   and c.a.name == "aten.bmm.default" for c in report.comparisons)


def test_a_fault_past_a_constant_placed_otherwise_is_still_found(tmp_path):
    """The attention's output x1.05 in the eager run is found at step 0 where the box's output is
    read (attn.out). Not yet at the attention itself: the box's one-run-only ops include eager's
    additive mask made by the model, so their innermost common module is the model."""
    report = probe.compare(_run_masked(tmp_path / "sdpa", False), _run_masked(tmp_path / "eager", True, 1.05))
    d = report.divergence
    assert d is not None, report.conclusion
    assert d.step == 0 and d.rule == "unmatched producer", (d.op.id, d.rule)
    assert "of forward:attn.out[0]:" in d.comparison.message, d.comparison.message
