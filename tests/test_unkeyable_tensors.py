"""Tensors the tracer cannot key (inference, sparse, nested, zero) never crash training, in any
mode, and are recorded as skipped; conjugate and negative views get their own statistics; the op
record is one field list; filters that match nothing and eager compiled regions are said once."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import probe
from probe.errors import ProbeError, ProbeWarning
from probe.rundir import layout
from probe.rundir.op_record_fields import OP_RECORD_FIELDS, RECORD_FIELD_INDEX
from probe.rundir.op_record_json import decode, encode

MODES = ["structure", "stats", "dump", "free_benchmark", "upcast"]


def _unkeyable_workload() -> dict[str, torch.Tensor]:
    """One op of each kind the tracer cannot key, and ordinary ops around them."""
    with torch.inference_mode():
        inference = torch.ones(3) * 2
    sparse = torch.eye(3).to_sparse() * 2
    dense_of_sparse = sparse.to_dense()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) * 2
    x = torch.linspace(-1, 1, 5, requires_grad=True)
    torch.sgn(x).sum().backward()  # sgn's backward makes an _efficientzerotensor
    return {"inference": inference, "sparse": sparse.to_dense(), "dense": dense_of_sparse,
            "nested": nested.to_padded_tensor(0.0), "grad": x.grad}


@pytest.mark.parametrize("mode", MODES)
def test_unkeyable_tensors_train_on_and_are_recorded_as_skipped(tmp_path, mode):
    expected = _unkeyable_workload()
    with probe.mode(mode, out=tmp_path / "run") as session:
        got = _unkeyable_workload()
        session.step()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name

    ops = probe.load(tmp_path / "run").ops(0)
    skipped = {(op.name, io, t.skipped) for op in ops for io, ts in (("in", op.inputs), ("out", op.outputs))
               for t in ts if t.skipped}
    assert ("aten.mul.Tensor", "out", "inference") in skipped
    assert ("aten.mul.Tensor", "in", "sparse") in skipped
    assert ("aten.mul.Tensor", "in", "nested") in skipped
    assert ("aten._efficientzerotensor.default", "out", "zero") in skipped
    for op in ops:
        for t in (*op.inputs, *op.outputs):
            if t.skipped:
                assert t.stats is None and t.source is None
    if mode == "stats":  # ordinary ops keep their statistics
        to_dense = next(op for op in ops if op.name == "aten._to_dense.default")
        assert to_dense.inputs[0].skipped == "sparse"
        assert to_dense.outputs[0].stats["mean"] == pytest.approx(2 / 3)


def test_a_value_computed_from_an_inference_tensor_has_no_source(tmp_path):
    with probe.mode("structure", out=tmp_path / "run") as session:
        with torch.inference_mode():
            a = torch.ones(4) + 1
        b = a.clone() * 3  # a normal tensor again: keyed, with an edge from clone
        session.step()
    ops = probe.load(tmp_path / "run").ops(0)
    clone = next(op for op in ops if op.name == "aten.clone.default")
    mul = next(op for op in ops if op.name == "aten.mul.Tensor")
    assert clone.inputs[0].skipped == "inference" and clone.inputs[0].source is None
    assert mul.inputs[0].skipped is None and mul.inputs[0].source == (clone.index, 0)
    assert torch.equal(b, torch.full((4,), 6.0))


# -- conjugate and negative views ----------------------------------------------------------


def _true_stats(t: torch.Tensor) -> tuple[float, float, float]:
    t = t.resolve_conj().resolve_neg()
    x = (torch.view_as_real(t) if t.is_complex() else t).double()
    return x.min().item(), x.max().item(), x.mean().item()


def test_conjugate_view_statistics_are_of_its_values_not_its_base(tmp_path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, generator=gen)
    with probe.mode("stats", out=tmp_path / "run", inputs=True) as session:
        out = torch.fft.ihfft(x)  # conj(rfft(x)) / n: its output is a conjugate view
        part = torch.randn(5, dtype=torch.complex64, generator=gen).conj().imag  # a negative view
        back = torch.fft.hfft(out)  # reads a conjugate view
        session.step()
    assert out.is_conj() and part.is_neg()
    ops = probe.load(tmp_path / "run").ops(0)
    conj = next(op for op in ops if op.name == "aten._conj.default")
    got = conj.outputs[0].stats
    assert (got["min"], got["max"]) == pytest.approx(_true_stats(out)[:2])
    assert got["mean"] == pytest.approx(_true_stats(out)[2], abs=1e-7)
    base = conj.inputs[0].stats
    assert base["mean"] == pytest.approx(_true_stats(out.conj())[2], abs=1e-7)
    assert got["mean"] != pytest.approx(base["mean"], abs=1e-7)  # the bug: base's row reused
    neg = [op for op in ops if op.name == "aten._neg_view.default"][-1]
    assert neg.outputs[0].stats["mean"] == pytest.approx(-neg.inputs[0].stats["mean"], abs=1e-7)
    c2r = next(op for op in ops if op.name == "aten._fft_c2r.default")
    assert c2r.outputs[0].stats["mean"] == pytest.approx(back.double().mean().item(), rel=1e-6)


def test_a_conjugate_view_is_not_the_same_value_as_its_base(tmp_path):
    with probe.mode("structure", out=tmp_path / "run") as session:
        z = torch.ones(3, dtype=torch.complex64) * (1 + 2j)
        zc = z.conj()
        (zc + 1).abs()
        (z + 1).abs()
        session.step()
    ops = probe.load(tmp_path / "run").ops(0)
    conj = next(op for op in ops if op.name == "aten._conj.default")
    resolve = next(op for op in ops if op.name == "aten.clone.default")  # add resolves the view first
    adds = [op for op in ops if op.name == "aten.add.Tensor"]
    assert resolve.inputs[0].source == (conj.index, 0)  # reads the conjugate view
    assert adds[1].inputs[0].source == conj.inputs[0].source  # reads the base, not the view


# -- the op record -------------------------------------------------------------------------


def test_records_round_trip_through_the_one_field_list(tmp_path):
    with probe.mode("structure", out=tmp_path / "run", stack=True) as session:
        with torch.inference_mode():
            torch.ones(2) * 2
        torch.randn(3, 3).mm(torch.randn(3, 3))
        session.step()
    lines = (layout.step_dir(tmp_path / "run", 0, 0) / layout.OPS_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert all(set(row) <= {f.key for f in OP_RECORD_FIELDS} for row in rows)
    for row in rows:
        record = decode(row)
        assert json.loads(json.dumps(encode(record))) == row
        assert record[RECORD_FIELD_INDEX["index"]] == row["i"]
    assert any("skip" in row for row in rows) and any("site" in row for row in rows)
    assert not any("skip" in row for row in rows if row["name"] == "aten.mm.default")


def test_an_older_record_without_the_new_fields_still_loads():
    old = {"i": 0, "id": "forward::aten.mm.default:0", "name": "aten.mm.default", "phase": "forward",
           "module": "", "call": 0, "stack": [], "in": [["float32", [2, 2], None], ["float32", [2, 2],
           [3, 0, True]]], "out": [["float32", [2, 2], 0]]}
    record = decode(old)
    assert record[RECORD_FIELD_INDEX["skipped"]] == ()
    assert record[RECORD_FIELD_INDEX["callsite"]] is None
    assert record[RECORD_FIELD_INDEX["outputs"]] == (("float32", (2, 2), False),)


@pytest.mark.parametrize(("damage", "named"), [
    (lambda r: r.pop("id"), "'id'"),
    (lambda r: r.update(i="0"), "'i'"),
    (lambda r: r.update({"in": [["float32", [2, "2"], None]]}), "'in'"),
    (lambda r: r.update({"in": [["float32", [2], [1, 0]]]}), "'in'"),
    (lambda r: r.update(out={"a": 1}), "'out'"),
    (lambda r: r.update(stack="model.fc"), "'stack'"),
    (lambda r: r.update(group={"size": 2}), "'group'"),
    (lambda r: r.update(skip=[["in", 0, "bogus"]]), "'skip'"),
])
def test_a_damaged_record_names_its_field(damage, named):
    row = {"i": 0, "id": "x", "name": "aten.mm.default", "phase": "forward", "module": "", "call": 0,
           "stack": [], "in": [], "out": []}
    damage(row)
    with pytest.raises(ProbeError, match=named):
        decode(row)
    with pytest.raises(ProbeError, match="JSON object"):
        decode([row])


def test_a_damaged_ops_file_is_a_probe_error_naming_the_file(tmp_path):
    with probe.mode("structure", out=tmp_path / "run") as session:
        torch.ones(2) * 2
        session.step()
    ops_path = layout.step_dir(tmp_path / "run", 0, 0) / layout.OPS_FILE
    row = json.loads(ops_path.read_text().splitlines()[0])
    row["out"] = "nope"
    ops_path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ProbeError, match=r"ops\.jsonl.*'out'"):
        probe.load(tmp_path / "run").ops(0)


# -- what the user is told -----------------------------------------------------------------


def _probe_warnings(run) -> list[str]:
    import probe.errors

    probe.errors._warned.clear()  # warn_once is per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProbeWarning)
        run()
    return [str(w.message) for w in caught if issubclass(w.category, ProbeWarning)]


@pytest.mark.parametrize(("option", "value"), [("ops", ["mmm"]), ("modules", ["nope*"])])
def test_a_filter_that_matches_nothing_is_said_once(tmp_path, option, value):
    model = torch.nn.Linear(3, 3)

    def run():
        with probe.mode("structure", out=tmp_path / option, model=model, **{option: value}) as session:
            for _ in range(2):
                model(torch.ones(2, 3)).sum().backward()
                session.step()

    said = [m for m in _probe_warnings(run) if "selected none" in m]
    assert len(said) == 1 and f"{option}={value}" in said[0]
    assert "aten.addmm.default" in said[0] or "aten.t.default" in said[0]


def test_a_filter_that_matches_is_not_warned_about(tmp_path):
    def run():
        with probe.mode("structure", out=tmp_path / "r", ops=["mm"]) as session:
            torch.ones(2, 2).mm(torch.ones(2, 2))  # a step with an mm ...
            session.step()
            torch.ones(2) * 2  # ... then one without
            session.step()

    assert not [m for m in _probe_warnings(run) if "selected none" in m]


def test_compiled_regions_are_mentioned_only_when_one_runs(tmp_path):
    compiled = torch.compile(lambda x: x * 2 + 1)

    def without_compile():
        with probe.mode("structure", out=tmp_path / "a") as session:
            torch.ones(3) * 2
            session.step()

    def with_compile():
        with probe.mode("structure", out=tmp_path / "b") as session:
            compiled(torch.ones(3))
            session.step()

    assert not [m for m in _probe_warnings(without_compile) if "run eagerly" in m]
    assert len([m for m in _probe_warnings(with_compile) if "run eagerly" in m]) == 1


def test_compiled_keep_runs_compiled_regions_with_their_compiled_numerics(tmp_path):
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1)

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 32, generator=gen), torch.randn(32, 32, generator=gen)
    compiled = f(x, w)
    with probe.mode("stats", out=tmp_path / "r", compiled="keep") as session:
        kept = f(x, w)
        session.step()
    assert torch.equal(kept, compiled)


def test_free_benchmark_skips_outputs_defined_only_up_to_sign(tmp_path):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=gen)
    with probe.mode("free_benchmark", out=tmp_path / "r") as session:
        torch.linalg.eigh(a @ a.T)
        torch.linalg.svd(a)
        session.step()
    checks = {(c.name, c.output): c for c in probe.load(tmp_path / "r").checks()}
    for name, output in (("aten._linalg_eigh.default", 1), ("aten._linalg_svd.default", 0),
                         ("aten._linalg_svd.default", 2)):
        assert checks[(name, output)].verdict == "skip"
        assert "up to sign" in checks[(name, output)].reason
    assert checks[("aten._linalg_eigh.default", 0)].verdict != "skip"  # eigenvalues are checked
    assert checks[("aten._linalg_svd.default", 1)].verdict != "skip"


def test_a_buffer_filled_slice_by_slice_is_unwritten_memory_until_full(tmp_path):
    # DeepSeek-style attention: a new_empty buffer, one slice copied in, then a view of the other
    # slice taken before it is filled. That view holds whatever the allocator left: its statistics
    # differed between two identical runs (NaN in one), a false divergence. Once every element
    # is written, the buffer is a value again.
    a, b = torch.randn(2, 16), torch.randn(2, 8)
    with probe.mode("stats", out=tmp_path):
        buffer = a.new_empty(2, 24)
        buffer[:, :16].copy_(a)
        buffer[:, 16:].copy_(b)
        (buffer * 2).sum()
    ops = probe.load(tmp_path).ops(0)
    slices = [op for op in ops if op.name == "aten.slice.Tensor"]
    assert len(slices) == 2 and all(op.outputs[0].stats is None for op in slices), slices
    doubled = next(op for op in ops if op.name == "aten.mul.Tensor")
    expected = torch.cat([a, b], dim=1) * 2
    assert doubled.outputs[0].stats["max"] == pytest.approx(float(expected.max()))
