"""Ops that exist in one run only are not a blind spot: a module re-implemented in run B (same
dtype, other ops) that computes wrongly is the first divergence, a faithful re-implementation
is rounding only; and the fp64 replay can be bounded (``replay_limit``) without losing the answers."""

from __future__ import annotations

import pytest
import torch

import probe
from probe.cli import main
from probe.errors import ProbeError

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from test_precision_divergence import DUMP, NORM, O_PROJ, STATS, _llama, _record  # noqa: E402

ACT = "model.layers.1.mlp.act_fn"
MLP_MUL = "forward:model.layers.1.mlp[0]:aten.mul.Tensor:0"  # act_fn(gate_proj(x)) * up_proj(x)


def _silu_by_hand(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def _silu_with_a_bug(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.1 * x)


def _run(out, modes, act=None):
    """Both runs fp32; in B, ``layers.1.mlp.act_fn`` (SiLU, one aten op) replaced by ``act``."""
    model = _llama()
    if act is not None:
        model.get_submodule(ACT).forward = act
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with probe.mode(list(modes), out=out, model=model):
        model(input_ids=ids, labels=ids).loss.backward()
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return {modes: _run(root / "-".join(modes), modes) for modes in (DUMP, STATS)}


@pytest.mark.parametrize("modes", [DUMP, STATS], ids=["dump", "stats"])
def test_a_wrong_reimplementation_of_a_module_is_the_first_divergence(references, tmp_path, modes):
    report = probe.compare(references[modes], _run(tmp_path / "b", modes, _silu_with_a_bug))
    d = report.divergence
    assert d is not None, report.conclusion
    assert d.op.module == ACT and d.rule == "unmatched producer", (d.op.id, d.comparison.message)
    assert d.op_a is None and d.op_b is not None  # the re-implementation's ops exist in run B only
    assert report.first_divergence == (None, d.op_b)
    message = d.comparison.message
    assert "exist in run B only" in message and f"in {ACT})" in message
    assert "aten.sigmoid.default" in message and f"input 0 of {MLP_MUL}" in message
    assert report.summary["first_divergence"]["module"] == ACT
    assert report.conclusion == f"first divergence at {d.op_b.id} in {ACT} (rule: unmatched producer)"
    # Nothing before it is an error, and what it causes downstream is (its consumer first).
    order = report.comparisons
    assert all(c.verdict != "error" for c in order[:order.index(d.comparison)])
    consumer = next(c for c in order if c.a is not None and c.a.id == MLP_MUL)
    assert consumer.verdict == "error" and consumer.rule in ("carried", "propagation", "replay")
    assert not consumer.enters


def test_the_faulty_modules_ops_are_unmatched_on_both_sides(references, tmp_path):
    """Why the rule is needed: no op of the faulty module is matched (silu in A; mul, sigmoid, mul
    in B), and each matched op computes correctly on its own inputs."""
    report = probe.compare(references[DUMP], _run(tmp_path / "b", DUMP, _silu_with_a_bug))
    unmatched_b = [c for c in report.comparisons if c.a is None and c.b is not None and c.b.module == ACT]
    assert unmatched_b and {c.b.name for c in unmatched_b} >= {"aten.sigmoid.default", "aten.mul.Tensor"}
    unmatched_a = [c for c in report.comparisons if c.b is None and c.a is not None and c.a.module == ACT]
    assert [c.a.name for c in unmatched_a if c.a.phase == "forward"] == ["aten.silu.default"]


@pytest.mark.parametrize("modes", [DUMP, STATS], ids=["dump", "stats"])
def test_a_faithful_reimplementation_is_rounding_only(references, tmp_path, modes):
    report = probe.compare(references[modes], _run(tmp_path / "b", modes, _silu_by_hand))
    assert report.divergence is None, report.conclusion
    assert report.counts["error"] == 0 and report.ok
    assert report.counts["unmatched"] > 0  # the two implementations' ops stay unmatched
    assert not any(row["rule"] == "unmatched producer" for row in report.rows)


def test_replay_limit_zero_keeps_the_answers_and_says_why(tmp_path):
    reference = _record(tmp_path / "a", DUMP)
    healthy = probe.compare(reference, _record(tmp_path / "autocast", DUMP, autocast=True), replay_limit=0)
    assert healthy.divergence is None and healthy.counts["error"] == 0
    assert healthy.conclusion == "no divergence: differences consistent with bf16 autocast"
    warned = [row for row in healthy.rows if row["verdict"] == "warning"]
    assert len(warned) > 100 and {row["rule"] for row in warned} == {"propagation"}
    assert sum("replay disabled (replay_limit=0)" in row["message"] for row in warned) > 100
    for fault, module in (("norm", NORM), ("o_proj", O_PROJ)):
        report = probe.compare(reference, _record(tmp_path / fault, DUMP, fault=fault), replay_limit=0)
        d = report.divergence
        assert d is not None and d.op.module == module and d.rule == "lowered precision", fault
    report = probe.compare(reference, _run(tmp_path / "act", DUMP, _silu_with_a_bug), replay_limit=0)
    assert report.divergence is not None and report.divergence.op.module == ACT


def test_replay_limit_by_size(tmp_path):
    """Ops whose inputs exceed the limit fall back to propagation and say so; smaller ones replay."""
    reference = _record(tmp_path / "a", DUMP)
    report = probe.compare(reference, _record(tmp_path / "b", DUMP, autocast=True), replay_limit=2048)
    warned = [row for row in report.rows if row["verdict"] == "warning"]
    skipped = [row for row in warned if "exceed replay_limit=2048" in row["message"]]
    assert skipped and all(row["rule"] == "propagation" for row in skipped)
    assert any(row["rule"] == "replay" for row in warned)
    assert report.divergence is None and report.counts["error"] == 0
    with pytest.raises(ProbeError, match="replay_limit"):
        probe.compare(reference, reference, replay_limit=-1)


def test_cli_replay_limit(references, tmp_path, capsys):
    b = _run(tmp_path / "b", DUMP, _silu_with_a_bug)
    out = tmp_path / "report"
    code = main(["compare", str(references[DUMP]), str(b), "--replay-limit", "0", "-o", str(out),
                 "--fail-on-divergence"])
    assert code == 1
    summary = (out / "report.json").read_text()
    assert '"rule": "unmatched producer"' in summary and ACT in summary


MLP = "model.layers.1.mlp"


def _scaled_output_run(out, autocast: bool, factor: float | None):
    """Two AdamW steps of a tiny Llama (stats); from step 1 on, ``MLP``'s output times ``factor``:
    a ``mul`` that exists in this run only, between two ops both runs have."""
    from hf_models import tiny_llama, train_steps

    model = tiny_llama(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_key_value_heads=4)
    mlp, on = model.get_submodule(MLP), [False]
    forward = mlp.forward
    if factor is not None:
        mlp.forward = lambda x: forward(x) * factor if on[0] else forward(x)
    with probe.mode("stats", out=out, model=model) as session:
        train_steps(model, session, autocast=autocast, before_step=lambda step: on.__setitem__(0, step >= 1))
    return out


@pytest.fixture(scope="module")
def fp32_reference(tmp_path_factory):
    return _scaled_output_run(tmp_path_factory.mktemp("fp32") / "a", autocast=False, factor=None)


def test_an_output_scaled_by_5_percent_under_autocast_is_found_at_its_module_and_step(fp32_reference,
                                                                                     tmp_path):
    # The residual add after the scaled output was judged "32 x the inputs' 0.048 + rounding":
    # the scaled value itself counted as the difference upstream. The add's input is the matched
    # down_proj's output passed through one multiplication by a number: its difference there is
    # down_proj's (0.007 under bf16 autocast) plus one bf16 rounding, with margin 2, far below 0.048.
    report = probe.compare(fp32_reference, _scaled_output_run(tmp_path / "b", autocast=True, factor=1.05))
    d = report.divergence
    assert d is not None, report.conclusion
    assert (d.step, d.op.module, d.rule) == (1, MLP, "unmatched producer"), (d.op.id, d.comparison.message)
    assert d.op_a is None and d.op_b.name == "aten.mul.Tensor"
    assert "beyond 2 x the" in d.comparison.message and "exist in run B only" in d.comparison.message
    assert report.conclusion == f"first divergence at {d.op_b.id} in {MLP} (rule: unmatched producer)"


def test_the_same_autocast_run_unscaled_is_no_divergence(fp32_reference, tmp_path):
    # The bound the scaled output exceeds keeps autocast's own casts (ops of run B only before
    # every matmul, the same kind of path) below it.
    report = probe.compare(fp32_reference, _scaled_output_run(tmp_path / "b", autocast=True, factor=None))
    assert report.divergence is None and report.ok, report.conclusion
    assert report.conclusion == "no divergence: differences consistent with bf16 autocast"


class _Rows(torch.nn.Module):
    """A linear layer whose output rows are taken whole, by an index (``h[arange]``: backward
    ``new_zeros`` of ``h``'s shape, ``index_put``) or as a strided view (backward ``new_zeros`` of
    its storage's element count, ``as_strided``, ``copy_``), then scaled by ``factor``."""

    def __init__(self, by_index: bool, factor: float = 1.0):
        super().__init__()
        self.inner = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)
        self.by_index, self.factor = by_index, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h = h[torch.arange(h.shape[0])] if self.by_index else h.as_strided(h.shape, h.stride())
        return self.head(h * self.factor if self.factor != 1.0 else h).square().mean()


def _rows_run(out, by_index: bool, factor: float = 1.0):
    torch.manual_seed(0)
    model = _Rows(by_index, factor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with probe.mode("stats", out=out, model=model) as session:
        for _ in range(2):
            model(x).backward()
            opt.step()
            opt.zero_grad()
            session.step()
    return out


def test_zeros_autograd_makes_of_other_shapes_in_two_implementations_are_never_paired(tmp_path):
    # The class a compiled JetMoe run met in a suite whose earlier tests had changed what dynamo
    # compiled (a frame past its recompile limit runs eagerly): one run's backward made
    # new_zeros(32, 64), the other's new_zeros(2048), and
    # paired by name alone they were a 'shape' divergence. An op reading no tensor's values is
    # a constant of its call: of another shape, it is another constant, not the same one changed.
    reference = _rows_run(tmp_path / "a", by_index=True)
    run_a = probe.load(reference)
    zeros = [op for op in run_a.ops(0) if op.name == "aten.new_zeros.default"]
    assert [op.outputs[0].shape for op in zeros] == [(8, 16)]
    strided = _rows_run(tmp_path / "b", by_index=False)
    assert [op.outputs[0].shape for op in probe.load(strided).ops(0)
            if op.name == "aten.new_zeros.default"] == [(128,)]
    report = probe.compare(reference, strided)
    assert report.divergence is None and report.ok, report.conclusion
    pairs = [c for c in report.comparisons if (c.a or c.b).name == "aten.new_zeros.default"]
    assert pairs and all(c.a is None or c.b is None for c in pairs)
    # The same strided implementation computing otherwise is still found, where it does.
    wrong = probe.compare(reference, _rows_run(tmp_path / "wrong", by_index=False, factor=1.5))
    d = wrong.divergence
    assert d is not None and d.step == 0 and d.op.module == "", wrong.conclusion


class _Positions(torch.nn.Module):
    """Sinusoidal positions as Pegasus-X builds them: a buffer ``zeros`` whose two halves ``copy_``
    fills (sin, cos), read broadcast over the batch (``expand``); ``scale``: a planted fault."""

    scale: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        angles = positions * torch.exp(-torch.arange(8, dtype=torch.float32) / 4)
        table = torch.zeros(x.shape[1], 16)
        table[:, :8] = torch.sin(angles)
        table[:, 8:] = torch.cos(angles)
        out = table[None].expand(x.shape[0], -1, -1)
        return out * self.scale if self.scale is not None else out


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.positions, self.out = torch.nn.Linear(16, 16), _Positions(), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(x) + self.positions(x))


def test_a_buffer_filled_in_parts_and_read_broadcast_is_measured_where_it_is_read(tmp_path):
    # The add reads the table through its `expand`, and its recorded source is the last `copy_`
    # (half of the table): no statistics of the value read. Run B scales the positions by 1.015 in
    # an op of its own; before, that difference was unknown at the add, which the thresholds alone
    # then called the divergence, one op after the fault (Pegasus-X's embed_positions in the zoo).
    # The table's halves combined are its statistics, and read broadcast, its values repeated.
    def train(out, scale):
        torch.manual_seed(0)
        model = _Encoder()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with probe.mode("stats", out=out, model=model) as session:
            for step in range(2):
                model.positions.scale = scale if step == 1 else None
                x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(step))
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                session.step()
    train(tmp_path / "a", None)
    train(tmp_path / "b", 1.015)
    d = probe.compare(tmp_path / "a", tmp_path / "b").divergence
    assert d is not None and d.step == 1 and d.op.module == "positions", d and (d.step, d.op.id)
    train(tmp_path / "c", None)
    assert probe.compare(tmp_path / "a", tmp_path / "c").divergence is None
