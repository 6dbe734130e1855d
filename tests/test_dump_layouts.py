"""Every layout the dump meets reads back as it was, or says by name why it was not stored.

Each tensor is made outside the session and read by one op inside it (``clone``, or an op that
reads it), so the op's input is the tensor and its output a copy of it; both are read back
through ``probe.load(...).tensor(...)`` and compared with the original: equal values
(``torch.equal`` on dense equivalents) and the same layout (sparse, nested, quantized, conjugate
and negative views, strides). A layout the dump cannot store has an entry with a status naming it,
which the reader accepts: the rest of the step reads. Before, a sparse CSR/CSC/BSR/BSC tensor made
the whole step unreadable (``"stride": []``), and sparse, nested and quantized tensors were not
dumped at all.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import probe
from probe import ProbeError
from probe.exporters.msprobe import export_msprobe
from probe.modes.dump.file_names import TENSOR_INDEX_FILE, tensors_dir
from probe.modes.dump.shards import read_header

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse .* support is in beta:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning"),
]


def _dense() -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).reshape(4, 6).remainder(5).sub(1.5)


def _nested() -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3), torch.randn(0, 3)])


LAYOUTS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse_coo": lambda: _dense().to_sparse(),
    "sparse_coo uncoalesced": lambda: torch.sparse_coo_tensor(
        torch.tensor([[1, 0, 1], [2, 0, 2]]), torch.tensor([1.0, 2.0, 3.0]), (4, 6)),
    "sparse_coo hybrid": lambda: _dense().to_sparse(1),
    "sparse_csr": lambda: _dense().to_sparse_csr(),
    "sparse_csc": lambda: _dense().to_sparse_csc(),
    "sparse_bsr": lambda: _dense().to_sparse_bsr((2, 3)),
    "sparse_bsc": lambda: _dense().to_sparse_bsc((2, 2)),
    "nested": _nested,
    "quantized per tensor": lambda: torch.quantize_per_tensor(_dense(), 0.25, 3, torch.quint8),
    "quantized per channel": lambda: torch.quantize_per_channel(
        _dense(), torch.tensor([0.5, 0.25, 0.125, 1.0], dtype=torch.float64), torch.tensor([0, 1, -2, 3]), 0,
        torch.qint8),
    "quantized transposed": lambda: torch.quantize_per_tensor(_dense(), 0.5, 0, torch.qint32).t(),
}
"""The layouts stored in parts: made, then read by ``clone`` inside the session."""

VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "conjugate": lambda: torch.complex(_dense(), -_dense()).conj(),
    "negative": lambda: torch._neg_view(_dense()),
    "zero-size": lambda: torch.empty(0, 3),
    "transposed": lambda: _dense().t(),
    "expanded": lambda: _dense()[:1].expand(5, 6),
    "0-stride scalar": lambda: torch.tensor(2.5).expand(3, 3),
    "sliced": lambda: _dense()[1:, ::2],
}
"""Strided tensors the dump stores as a view of their storage's bytes."""


def _same(back: torch.Tensor, original: torch.Tensor) -> None:
    """``back`` is ``original``: its layout and its values (dense equivalents), bit for bit."""
    assert back.layout == original.layout and back.dtype == original.dtype
    if original.is_nested:
        assert back.is_nested
        assert all(torch.equal(a, b) for a, b in zip(back.unbind(), original.unbind(), strict=True))
        return
    assert back.shape == original.shape
    if original.is_sparse:
        assert back.is_coalesced() == original.is_coalesced()
        assert torch.equal(back._indices(), original._indices())
        assert torch.equal(back._values(), original._values())
    elif original.layout != torch.strided:
        assert torch.equal(back.values(), original.values())
        assert torch.equal(back.to_dense(), original.to_dense())
    elif original.is_quantized:
        assert back.qscheme() == original.qscheme()
        assert torch.equal(back.int_repr(), original.int_repr())
        assert torch.equal(back.dequantize(), original.dequantize())
    else:
        assert back.stride() == original.stride()
        assert back.is_conj() == original.is_conj() and back.is_neg() == original.is_neg()
        assert torch.equal(back.resolve_conj().resolve_neg(), original.resolve_conj().resolve_neg())


def _clone_each(out: Path, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    with probe.mode("dump", out=out) as session:
        copies = [t.clone() for t in tensors]
        session.step()
    return copies


def _clones(run: probe.Run) -> list:
    return [op for op in run.ops(0) if op.name == "aten.clone.default"]


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_a_layout_stored_in_parts_reads_back_in_its_layout(tmp_path, kind):
    original = LAYOUTS[kind]()
    (copy,) = _clone_each(tmp_path / "r", [original])
    run = probe.load(tmp_path / "r")
    (op,) = _clones(run)
    entry = run.dump(0).entries[(op.index, "input", 0)]
    assert entry.status is None and entry.layout != "strided", entry
    _same(run.tensor(op.id, "input", 0), original)
    _same(run.tensor(op.id, "output", 0), copy)


def test_a_step_with_every_layout_reads_whole(tmp_path):
    made = {**LAYOUTS, **VIEWS}
    originals = [make() for make in made.values()]
    jagged = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    with probe.mode("dump", out=tmp_path / "r") as session:
        copies = [t.clone() for t in originals]
        torch.ops.aten._efficientzerotensor.default([2, 3])
        doubled = jagged * 2
        session.step()
    run = probe.load(tmp_path / "r")
    assert run.damaged_steps() == []
    ops = _clones(run)
    assert len(ops) == len(made)
    for kind, op, original, copy in zip(made, ops, originals, copies, strict=True):
        try:
            _same(run.tensor(op.id, "input", 0), original)
            _same(run.tensor(op.id, "output", 0), copy)
        except AssertionError as e:
            raise AssertionError(f"{kind}: {e}") from None
    zero = next(op for op in run.ops(0) if op.name == "aten._efficientzerotensor.default")
    assert torch.equal(run.tensor(zero.id, "output", 0), torch.zeros(2, 3))  # a ZeroTensor's values: zeros
    # A jagged nested tensor is a Python subclass: the op the tracer sees is on its values.
    (mul,) = [op for op in run.ops(0) if op.name == "aten.mul.Tensor"]
    assert torch.equal(run.tensor(mul.id, "input", 0), jagged.values())
    assert torch.equal(run.tensor(mul.id, "output", 0), doubled.values())


def test_a_layout_the_dump_cannot_store_is_named_and_the_step_reads(tmp_path):
    mkldnn = torch.randn(2, 3).to_mkldnn()
    packed = torch.quantize_per_tensor(torch.rand(4, 6), 0.1, 0, torch.quint4x2)
    plain = torch.randn(3)
    with probe.mode("dump", out=tmp_path / "r") as session:
        mkldnn_dense = mkldnn.to_dense()
        packed_floats = packed.dequantize()
        doubled = plain * 2
        session.step()
    run = probe.load(tmp_path / "r")
    assert run.damaged_steps() == []
    ops = {op.name: op for op in run.ops(0)}
    statuses = {name: run.dump(0).entries[(ops[name].index, "input", 0)].status
                for name in ("aten._to_dense.default", "aten.dequantize.self")}
    assert statuses["aten._to_dense.default"] == "not dumpable: no storage"
    assert statuses["aten.dequantize.self"] == "not dumpable: quantized quint4x2 per_tensor_affine"
    with pytest.raises(ProbeError, match="quantized quint4x2"):
        run.tensor(ops["aten.dequantize.self"].id, "input", 0)
    assert torch.equal(run.tensor(ops["aten._to_dense.default"].id, "output", 0), mkldnn_dense)
    assert torch.equal(run.tensor(ops["aten.dequantize.self"].id, "output", 0), packed_floats)
    assert torch.equal(run.tensor(ops["aten.mul.Tensor"].id, "output", 0), doubled)


def _edit_index(run_dir: Path, edit: Callable[[list[dict]], None]) -> None:
    path = run_dir / "rank0" / "step0" / TENSOR_INDEX_FILE
    index = json.loads(path.read_text())
    edit(index["tensors"])
    path.write_text(json.dumps(index))


def test_entries_without_strides_from_earlier_probes_read(tmp_path):
    """A sparse tensor's entry as probes before parts wrote it (``"stride": []``, no data) is read:
    its tensor says why it has no data, every other tensor of the step reads."""
    original, plain = _dense().to_sparse_csr(), torch.randn(3)
    _clone_each(tmp_path / "r", [original, plain])

    def as_written_before(tensors: list[dict]) -> None:
        for e in tensors:
            if e.get("layout") == "sparse_csr":
                e.update(stride=[], blob=None, status="not dumpable: sparse")
                del e["layout"], e["parts"], e["params"]

    _edit_index(tmp_path / "r", as_written_before)
    run = probe.load(tmp_path / "r")
    assert run.damaged_steps() == []
    sparse_op, plain_op = _clones(run)
    with pytest.raises(ProbeError, match="not dumpable: sparse"):
        run.tensor(sparse_op.id, "input", 0)
    assert torch.equal(run.tensor(plain_op.id, "input", 0), plain)


def _indices_past_the_size(run_dir: Path, tensors: list[dict]) -> None:
    """Overwrite the first COO index in its shard with 99 (the tensor is 4 x 6)."""
    entry = next(e for e in tensors if e.get("layout") == "sparse_coo")
    index = json.loads((run_dir / "rank0" / "step0" / TENSOR_INDEX_FILE).read_text())
    shard_name, blob_name = index["blobs"][str(entry["parts"]["indices"]["blob"])]
    shard = tensors_dir(run_dir, 0, 0) / shard_name
    data_start, header = read_header(shard)
    begin = data_start + header[blob_name]["data_offsets"][0]
    data = bytearray(shard.read_bytes())
    data[begin : begin + 8] = (99).to_bytes(8, "little")
    shard.write_bytes(bytes(data))


PART_DAMAGE: dict[str, tuple[str, Callable[[dict], None], str]] = {
    "nested component past its buffer": ("nested", lambda e: e["params"].update(offsets=[0, 6, 10**6]),
                                         "past its buffer"),
    "negative scale": ("quantized_per_tensor", lambda e: e["params"].update(scale=-0.25), "scale"),
    "non-finite scale": ("quantized_per_tensor", lambda e: e["params"].update(scale=float("nan")), "scale"),
    "axis out of range": ("quantized_per_channel", lambda e: e["params"].update(axis=5), "axis 5"),
    "indices read as floats": ("sparse_csr", lambda e: e["parts"]["col_indices"].update(dtype="float32"),
                               "col_indices are torch.float32"),
    "a part missing": ("sparse_bsr", lambda e: e["parts"].pop("crow_indices"), "crow_indices"),
    "a part without its blob": ("sparse_csr", lambda e: e["parts"]["values"].update(blob=None),
                                "has no blob"),
    "a layout this probe does not know": ("sparse_csc", lambda e: e.update(layout="sparse_xyz"),
                                          "sparse_xyz"),
    "claims coalesced": ("sparse_coo", lambda e: e["params"].update(coalesced=True), "coalesced"),
}


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """One step holding a tensor of each layout (COO uncoalesced) and a plain one, read by ``clone``."""
    tensors = [LAYOUTS[kind]() for kind in ("sparse_coo uncoalesced", "sparse_csr", "sparse_csc",
                                            "sparse_bsr", "nested", "quantized per tensor",
                                            "quantized per channel")] + [torch.randn(3)]
    out = tmp_path_factory.mktemp("stored") / "r"
    _clone_each(out, tensors)
    return out, tensors


@pytest.mark.parametrize("damage", [*PART_DAMAGE, "indices past the size"])
def test_damaged_parts_are_refused_by_name_and_cost_only_their_tensor(stored, tmp_path, damage):
    run_dir = tmp_path / "r"
    shutil.copytree(stored[0], run_dir)
    if damage == "indices past the size":
        kind, message = "sparse_coo", "size is inconsistent with indices"
        _edit_index(run_dir, lambda tensors: _indices_past_the_size(run_dir, tensors))
    else:
        kind, edit, message = PART_DAMAGE[damage]
        _edit_index(run_dir, lambda tensors: [edit(e) for e in tensors if e.get("layout") == kind])
    run = probe.load(run_dir)
    ops = _clones(run)
    damaged = next(op for op in ops if run.dump(0).entries[(op.index, "input", 0)].layout
                   in (kind, "sparse_xyz"))
    with pytest.raises(ProbeError, match=message) as refused:
        run.tensor(damaged.id, "input", 0)
    assert TENSOR_INDEX_FILE in str(refused.value) or "safetensors" in str(refused.value)
    assert torch.equal(run.tensor(ops[-1].id, "input", 0), stored[1][-1])  # the rest of the step reads


def test_compare_compares_the_values_a_sparse_or_quantized_tensor_holds(tmp_path):
    def record(out: Path, shift: float) -> None:
        sparse = (_dense() + torch.eye(4, 6) * shift).to_sparse_csr()
        quantized = torch.quantize_per_tensor(_dense() + shift, 0.25, 3, torch.quint8)
        with probe.mode(["stats", "dump"], out=out) as session:
            sparse.clone(), quantized.clone()
            session.step()

    record(tmp_path / "a", 0.0)
    record(tmp_path / "same", 0.0)
    record(tmp_path / "b", 1.0)
    same = probe.compare(tmp_path / "a", tmp_path / "same")
    assert same.ok and [row["verdict"] for row in same.rows] == ["pass", "pass"]
    assert all(row["compared"] == "data" for row in same.rows), same.rows
    differ = probe.compare(tmp_path / "a", tmp_path / "b")
    assert [row["verdict"] for row in differ.rows] == ["error", "error"], differ.rows
    assert not differ.ok


def test_sparse_embedding_gradients_are_dumped_and_training_is_unchanged(tmp_path):
    def train(session: probe.Session | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 4, sparse=True)
        tokens = torch.tensor([[1, 2, 1], [7, 2, 9]])
        embedding(tokens).square().sum().backward()
        if session is not None:
            session.step()
        return embedding.weight.detach().clone(), embedding.weight.grad

    weight, grad = train(None)
    with probe.mode("dump", out=tmp_path / "r") as session:
        weight_traced, grad_traced = train(session)
    assert torch.equal(weight_traced, weight)
    assert torch.equal(grad_traced.to_dense(), grad.to_dense())
    run = probe.load(tmp_path / "r")
    backward = [op for op in run.ops(0) if op.phase == "backward" and op.outputs
                and op.outputs[0].shape == (10, 4)]
    dumped = [run.tensor(op.id, "output", 0) for op in backward]
    sparse = [t for t in dumped if t.layout == torch.sparse_coo]
    assert sparse, [op.name for op in backward]
    assert torch.equal(sparse[-1].coalesce().to_dense(), grad.coalesce().to_dense())


def test_replay_and_the_msprobe_export_read_tensors_stored_in_parts(tmp_path):
    sparse, compressed = _dense().to_sparse(), _dense().to_sparse_csr()
    quantized = torch.quantize_per_tensor(_dense(), 0.25, 3, torch.quint8)
    with probe.mode("dump", out=tmp_path / "r") as session:
        doubled = sparse * 2
        compressed.clone(), quantized.clone()
        session.step()
    run = probe.load(tmp_path / "r")
    for op in run.ops(0):  # each op re-run from its dumped inputs gives its dumped output exactly
        assert probe.replay(run, op.id)["max_ulp"] == 0, op.name
    written = export_msprobe(run, tmp_path / "msprobe")
    dumped = json.loads(written[0].read_text())["data"]
    mul = next(entry for name, entry in dumped.items() if ".mul." in name)
    saved = torch.load(written[0].parent / "dump_tensor_data" / mul["output"][0]["data_name"])
    assert saved.layout == torch.strided and torch.equal(saved, doubled.to_dense())
