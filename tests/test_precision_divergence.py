"""Precision-aware compare on HF models with planted faults: the planted module is the answer,
and two runs that differ only in precision policy report no divergence."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama, train_steps

import probe

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

DUMP, STATS = ("stats", "dump"), ("stats",)
NORM = "model.layers.1.post_attention_layernorm"
O_PROJ = "model.layers.1.self_attn.o_proj"


def _llama():
    return tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_key_value_heads=4)


def _norm_in_bf16_without_eps(norm: torch.nn.Module) -> None:
    """A re-implemented RMSNorm computing in bf16, without eps, cast back at the end."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.bfloat16)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))
        return (norm.weight.to(torch.bfloat16) * h).to(x.dtype)
    norm.forward = forward


def _bf16_round_trip_after(linear: torch.nn.Module) -> None:
    forward = linear.forward
    linear.forward = lambda x: forward(x).to(torch.bfloat16).to(torch.float32)


def _record(out, modes, autocast=False, fault=None):
    model = _llama()
    if fault == "norm":
        _norm_in_bf16_without_eps(model.get_submodule(NORM))
    elif fault == "o_proj":
        _bf16_round_trip_after(model.get_submodule(O_PROJ))
    elif fault == "weight":
        with torch.no_grad():
            model.model.layers[2].self_attn.o_proj.weight[3, 5] += 1e-3
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode(list(modes), out=out, model=model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return {modes: _record(root / "-".join(modes), modes) for modes in (DUMP, STATS)}


@pytest.mark.parametrize("modes", [DUMP, STATS], ids=["dump", "stats"])
def test_bf16_autocast_against_fp32_is_no_divergence_and_says_why(references, tmp_path, modes):
    report = probe.compare(references[modes], _record(tmp_path / "b", modes, autocast=True))
    assert report.first_divergence is None and report.ok
    assert report.counts["error"] == 0 and report.counts["warning"] > 100  # differ, explained
    assert report.conclusion == "no divergence: differences consistent with bf16 autocast"
    assert report.summary["conclusion"] == report.conclusion
    warned = [row for row in report.rows if row["verdict"] == "warning"]
    assert {row["rule"] for row in warned} <= {"replay", "propagation"}
    if modes == DUMP:  # matched ops with dumped inputs are judged by an fp64 replay
        assert sum(row["rule"] == "replay" for row in warned) > 100
    assert all("consistent with precision" in row["message"] for row in warned)


@pytest.mark.parametrize("modes", [DUMP, STATS], ids=["dump", "stats"])
def test_a_bf16_rmsnorm_inside_an_autocast_run_is_lowered_precision(references, tmp_path, modes):
    report = probe.compare(references[modes], _record(tmp_path / "b", modes, autocast=True, fault="norm"))
    d = report.divergence
    assert d is not None and d.op.module == NORM and d.rule == "lowered precision"
    assert d.op_a is None and d.op_b.name == "aten._to_copy.default"  # the cast exists in run B only
    assert report.first_divergence == (None, d.op_b)
    assert f"precision lowered in {NORM}: float32 -> bfloat16 by an explicit cast" in d.comparison.message
    assert report.summary["first_divergence"]["module"] == NORM
    assert report.summary["first_divergence"]["rule"] == "lowered precision"


@pytest.mark.parametrize("modes", [DUMP, STATS], ids=["dump", "stats"])
@pytest.mark.parametrize("fault, module", [("norm", NORM), ("o_proj", O_PROJ)])
def test_a_module_computed_in_bf16_in_an_fp32_run_is_blamed_on_itself(references, tmp_path, modes, fault,
                                                                        module):
    report = probe.compare(references[modes], _record(tmp_path / "b", modes, fault=fault))
    d = report.divergence
    assert d is not None and d.op.module == module, (d.op.id, d.comparison.message)
    assert d.rule == "lowered precision" and d.op.name == "aten._to_copy.default"
    # Nothing before it is an error, and what it causes downstream is.
    order = report.comparisons
    assert all(c.verdict != "error" for c in order[:order.index(d.comparison)])
    assert report.counts["error"] > 1 and d.chain[0] == d.op_b.id and len(d.chain) > 5


def test_stats_only_a_changed_weight_element_is_found_at_its_module(references, tmp_path):
    report = probe.compare(references[STATS], _record(tmp_path / "b", STATS, fault="weight"))
    d = report.divergence
    assert d is not None and d.op.module == "model.layers.2.self_attn.o_proj", d.op.id
    # The op reading the weight: the runs computed alike bit for bit up to it (the exact regime),
    # so the weight's own difference, however small, is where the divergence enters.
    assert d.op_a.name == "aten.t.default" and d.rule == "outside input"
    assert "differs while the runs computed alike bit for bit up to here" in d.comparison.message
    rows = [row for row in report.rows if row["op_a"] == d.op_a.id]
    assert rows[0]["verdict"] == "error" and rows[0]["rule"] == "outside input"


def test_report_files_carry_the_rule(references, tmp_path):
    report = probe.compare(references[STATS], _record(tmp_path / "b", STATS, fault="weight"))
    report.to_csv(tmp_path / "r.csv")
    report.to_html(tmp_path / "r.html")
    header = (tmp_path / "r.csv").read_text().splitlines()[0].split(",")
    assert "Rule" in header
    page = (tmp_path / "r.html").read_text()
    assert "rule <b>outside input</b>" in page and "first divergence at" in page


def _gpt2_run(out, dtype):
    model = tiny_gpt2(n_positions=32, n_embd=64, attn_implementation="eager").to(dtype)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode(list(DUMP), out=out, model=model):
        model(input_ids=ids, labels=ids).loss.backward()
    return out


def test_gpt2_fp16_against_fp32_is_no_divergence(tmp_path):
    report = probe.compare(_gpt2_run(tmp_path / "a", torch.float32), _gpt2_run(tmp_path / "b", torch.float16))
    assert report.first_divergence is None, report.conclusion
    assert report.counts["error"] == 0 and report.counts["warning"] > 50
    assert report.conclusion.startswith("no divergence: differences consistent with the precision of run B "
                                        "(float16 throughout")


def _qk_norm_run(out, arch: str, autocast: bool, fault: bool = False):
    """Two AdamW steps of a QK-norm model (its q_norm/k_norm return ``.to(input_dtype)``: under
    autocast a cast back to the bf16 its projection made); ``fault`` computes the final norm in bf16
    from the fp32 residual, a real lowering."""
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config)
    if fault:
        _norm_in_bf16_without_eps(model.get_submodule("model.norm"))
    with probe.mode("stats", out=out, model=model) as session:
        train_steps(model, session, autocast=autocast)
    return out


@pytest.mark.parametrize("arch", ["Qwen3", "Olmo2"])
def test_a_norm_casting_back_to_the_dtype_it_received_is_no_lowering(tmp_path, arch):
    # 19 of the 58 healthy autocast pairs the zoo called divergent stopped at a q_norm's cast
    # back to bf16: it restores what autocast's projection made, and lowers nothing.
    reference = _qk_norm_run(tmp_path / "a", arch, autocast=False)
    report = probe.compare(reference, _qk_norm_run(tmp_path / "b", arch, autocast=True))
    assert report.first_divergence is None and report.ok, report.conclusion
    assert report.conclusion == "no divergence: differences consistent with bf16 autocast"
    # The same models' real lowering (a norm of the fp32 residual in bf16) is still found there.
    faulty = probe.compare(reference, _qk_norm_run(tmp_path / "c", arch, autocast=True, fault=True))
    assert faulty.divergence is not None
    assert (faulty.divergence.rule, faulty.divergence.op.module, faulty.divergence.step) == \
        ("lowered precision", "model.norm", 0)


def _embedding_changed_run(out, autocast: bool, changed: bool):
    """Two AdamW steps of the tiny Llama; ``changed``: one embedding element x1.5 between them,
    written where nothing traces it (a silent corruption)."""
    model = _llama()
    with probe.mode("stats", out=out, model=model) as session:
        def corrupt(step: int) -> None:
            if changed and step == 1:
                with session.paused(), torch.no_grad():
                    model.model.embed_tokens.weight[3, 5] *= 1.5
        train_steps(model, session, autocast=autocast, before_step=corrupt)
    return out


def test_a_weight_changed_between_steps_of_an_autocast_run_is_named_where_it_is_read(tmp_path):
    # One element of a 128 x 64 embedding x1.5: far within the difference autocast's steps explain
    # in the weights, so only the state itself tells (run B's step 0 never left this value).
    reference = _embedding_changed_run(tmp_path / "a", autocast=False, changed=False)
    report = probe.compare(reference, _embedding_changed_run(tmp_path / "b", autocast=True, changed=True))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.op.module, d.step, d.rule) == ("model.embed_tokens", 1, "outside input")
    assert "changed between the steps" in d.comparison.message


def _autocast_pair(root, model_fn):
    """Two AdamW steps of ``model_fn()`` in fp32 (run A) and under bf16 autocast (run B)."""
    runs = []
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = model_fn()
        with probe.mode("stats", out=root / name, model=model) as session:
            train_steps(model, session, autocast=autocast)
        runs.append(root / name)
    return runs


def test_a_layer_norms_row_means_are_not_its_result(tmp_path):
    # At step 1 the embeddings autocast's step 0 changed reach GPT-Neo's first LayerNorm: its row
    # means (kept for the backward) cancel to near zero and differ by 0.6% where its normalised
    # rows agree to 1e-6. Judged by its result, the LayerNorm is rounding, not a divergence.
    def build():
        return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=512))
    a, b = _autocast_pair(tmp_path, build)
    report = probe.compare(a, b)
    assert report.first_divergence is None and report.ok, report.conclusion


def test_a_cast_to_the_dtype_of_the_operand_it_meets_is_no_lowering(tmp_path):
    # Mamba adds ``dt_proj.bias.to(dt.dtype)`` to dt, which autocast's projection made bf16: the
    # cast matches the precision the other operand brought (as DeBERTa's scale.to(query.dtype)).
    def build():
        return transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=128, hidden_size=64, num_hidden_layers=2, state_size=8, expand=2))
    a, b = _autocast_pair(tmp_path, build)
    report = probe.compare(a, b)
    assert report.first_divergence is None and report.ok, report.conclusion


class _CountingRouter(torch.nn.Module):
    """Routes each token to its top expert by near-tied logits, counts the tokens per expert
    (``histc``, then ``cumsum``, as MoE layers that sort tokens by expert do) and scales each
    token by its expert's running count."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(16, 4, bias=False)
        with torch.no_grad():  # experts 0 and 1 nearly tied: bf16 rounding flips some choices
            self.router.weight[1] = self.router.weight[0] * (1 + 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        chosen = logits.topk(1, dim=-1).indices.reshape(-1)
        counts = torch.histc(chosen.float(), bins=4, min=0, max=3)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return x * offsets[chosen].unsqueeze(-1).float() + logits.float().softmax(-1)[:, :1]


def test_tokens_counted_per_expert_under_autocast_are_no_divergence(tmp_path):
    # Under bf16 some tokens pick the other of two near-tied experts, and the counts per expert
    # and all computed from them differ. A choice made on values that differ may differ: no
    # divergence.
    runs = []
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = _CountingRouter()
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
        with probe.mode("stats", out=tmp_path / name, model=model), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(x).float().square().mean().backward()
        runs.append(tmp_path / name)
    chosen = [probe.load(r).ops(0) for r in runs]
    topk = [next(op for op in ops if op.name == "aten.topk.default") for ops in chosen]
    assert topk[0].outputs[1].stats != topk[1].outputs[1].stats  # the choices differ
    report = probe.compare(*runs)
    assert report.first_divergence is None and report.ok, report.conclusion


def test_the_gradient_of_a_bias_before_batch_norm_is_rounding_alone(tmp_path):
    """A convolution's bias before BatchNorm has a gradient that is zero in exact arithmetic (the
    norm removes each channel's mean): each run's is its own rounding, so bf16 autocast against
    fp32 is no divergence there."""
    def record(out, autocast):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                    torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, stride=2, padding=1),
                                    torch.nn.BatchNorm2d(16),
                                    torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        with probe.mode("stats", out=str(out), model=model) as session:
            for _ in range(2):
                x, y = torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 4, (4,), generator=gen)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = model(x)
                torch.nn.functional.cross_entropy(logits.float(), y).backward()
                opt.step()
                opt.zero_grad()
                session.step()

    record(tmp_path / "a", False)
    record(tmp_path / "b", True)
    report = probe.compare(tmp_path / "a", tmp_path / "b")
    assert report.divergence is None, report.conclusion


class _QkNormRotary(torch.nn.Module):
    """A query projection, its RMS norm computed in float32 and cast back to the dtype the query
    arrived in, then rotary angles computed in float32 from positions and cast to the query's
    dtype before they multiply it (NeoMME's attention under fp16 autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
        self.weight = torch.nn.Parameter(torch.ones(32))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        h = q.float()
        q = (self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype)
        angles = torch.arange(x.shape[1], device=x.device).float()[:, None] * self.inv_freq
        cos = angles.cos().repeat(1, 2).to(q.dtype)
        return self.out(q * cos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_meeting_a_query_a_norm_cast_back_is_no_lowering(tmp_path, dtype):
    # The rotary cast meets the query the norm put back in autocast's dtype: that operand brings
    # the dtype it arrived in (before, as the cast down of `F.linear(x.to(bf16), ...)` brings
    # none, it did not count, and the rotary cast was 'lowered precision').
    runs = []
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = _QkNormRotary()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(1)
        with probe.mode("stats", out=tmp_path / name, model=model) as session:
            for _ in range(2):
                with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                    out = model(torch.randn(2, 6, 32, generator=data))
                out.float().square().mean().backward()
                opt.step()
                opt.zero_grad()
                session.step()
        runs.append(tmp_path / name)
    report = probe.compare(*runs)
    assert report.first_divergence is None and report.ok, report.conclusion


def test_a_quotient_by_small_divisors_of_one_sign_amplifies_their_difference(tmp_path):
    # A divisor known by its statistics to differ by d relative (of the whole) differs by d rms(b)
    # absolutely, so an element |b| below the rms carries rms(b) / |b| times d into the quotient
    # (phimoe's router divides by clamped scores down to 1% of their rms: fp16 autocast was
    # 'propagation' at that div). A divisor changing sign bounds nothing: no amplification taken.
    from probe.analysis import precision

    scores = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    positive = scores.abs().clamp(min=0.002)
    with probe.mode("stats", out=str(tmp_path / "run")) as session:
        (scores / positive).sum()
        (scores / scores).sum()
        session.step()
    divs = [op for op in probe.load(tmp_path / "run").ops(0) if op.name == "aten.div.Tensor"]
    assert len(divs) == 2
    rms = float(positive.square().mean().sqrt())
    assert precision.condition(divs[0]) == pytest.approx(rms / 0.002, rel=1e-6)
    assert precision.condition(divs[1]) == 1.0
