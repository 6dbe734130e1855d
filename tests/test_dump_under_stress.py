"""Dump mode under stress: tensors larger than the memory budget, conjugate and negative views,
tensors without plain bytes, and a disk that fills up while the step is written."""

from __future__ import annotations

import errno
import json
import warnings
from pathlib import Path

import pytest
import torch

import probe
from probe import ProbeError
from probe.errors import ProbeWarning
from probe.modes.dump import shards
from probe.modes.dump.file_names import TENSOR_INDEX_FILE
from probe.rundir import layout
from tests.conftest import SharedBlockNet, train_steps

aten = torch.ops.aten
MiB = 1 << 20


def _same_bits(loaded: torch.Tensor, original: torch.Tensor) -> bool:
    """Bitwise equality of the values two tensors hold (conjugate / negative bits resolved)."""
    a, b = loaded.resolve_conj().resolve_neg(), original.resolve_conj().resolve_neg()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _ops(run, name: str, step: int = 0) -> list:
    return [op for op in run.ops(step) if op.name == name]


def _index(out: Path, step: int = 0) -> dict:
    return json.loads((layout.step_dir(out, 0, step) / TENSOR_INDEX_FILE).read_text())


# -- memory budget --------------------------------------------------------------------


def test_a_tensor_larger_than_the_budget_goes_in_pieces_and_reads_back_bit_identical(tmp_path):
    budget = 8 * MiB
    big = torch.randn(4096, 4096)  # 64 MiB
    with probe.mode("dump", out=tmp_path / "r", memory_budget=budget) as session:
        doubled = big.t().mul(2.0)   # a strided view of 64 MiB in, 64 MiB out
        small = torch.ones(8).add(1.0)
        session.step()
    run = probe.load(tmp_path / "r")
    (mul,) = _ops(run, "aten.mul.Tensor")
    loaded_in, loaded_out = run.tensor(mul.id, "input", 0), run.tensor(mul.id, "output", 0)
    assert _same_bits(loaded_in, big.t()) and loaded_in.stride() == big.t().stride()
    assert _same_bits(loaded_out, doubled) and loaded_out.stride() == doubled.stride()
    (add,) = _ops(run, "aten.add.Tensor")
    assert _same_bits(run.tensor(add.id, "output", 0), small)
    summary = run.step_info(0).manifest["modes"]["dump"]
    assert summary["complete"] and summary["lost"] == summary["skipped"] == 0
    # The mode's own accounting: no host buffer beyond the budget ever existed.
    assert 0 < summary["host_buffer_peak"] <= budget
    # Each large blob is a shard of its own, so the index format is unchanged.
    index = _index(tmp_path / "r")
    shard_of = {entry["blob"]: index["blobs"][str(entry["blob"])][0] for entry in index["tensors"]}
    big_blobs = [run.dump(0).entries[(mul.index, io, 0)].blob for io in ("input", "output")]
    assert len({shard_of[b] for b in big_blobs}) == 2


def test_on_budget_skip_skips_a_tensor_larger_than_the_budget_and_keeps_the_rest(tmp_path):
    budget = 8 * MiB
    big = torch.randn(4096, 4096)
    with probe.mode("dump", out=tmp_path / "r", memory_budget=budget, on_budget="skip",
                    tensors="outputs") as session:
        big.mul(2.0)
        small = torch.ones(8).add(1.0)
        session.step()
    run = probe.load(tmp_path / "r")
    (mul,) = _ops(run, "aten.mul.Tensor")
    assert run.dump(0).entries[(mul.index, "output", 0)].status == "skipped: memory budget"
    with pytest.raises(ProbeError, match="memory budget"):
        run.tensor(mul.id, "output", 0)
    (add,) = _ops(run, "aten.add.Tensor")
    assert _same_bits(run.tensor(add.id, "output", 0), small)
    summary = run.step_info(0).manifest["modes"]["dump"]
    assert summary["skipped"] == 1 and summary["host_buffer_peak"] <= budget


# -- conjugate and negative views -------------------------------------------------------


def _views() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    z = torch.randn(16, dtype=torch.complex64)
    r = torch.randn(16)
    conj = z.conj()
    return {
        "base": z.mul(1.0),
        "conj": conj,
        "conj_times_2": conj.mul(2.0),        # a conj view read by an op
        "ihfft": torch.fft.ihfft(r),          # returns a conjugate view
        "ifft": torch.fft.ifft(z),
        "neg": torch._neg_view(r),
        "neg_plus_1": torch._neg_view(r).add(1.0),
    }


def test_conjugate_and_negative_views_read_back_as_their_own_values(tmp_path):
    plain = _views()
    with probe.mode("dump", out=tmp_path / "r", checksum=True) as session:
        traced = _views()
        session.step()
    for key in plain:  # training is bit-identical
        assert _same_bits(traced[key], plain[key]), key
    assert traced["conj"].is_conj() and traced["ihfft"].is_conj() and traced["neg"].is_neg()

    run = probe.load(tmp_path / "r")
    dump = run.dump(0)
    conj_op = _ops(run, "aten._conj.default")[0]  # z.conj(); ihfft makes the next
    loaded_conj = run.tensor(conj_op.id, "output", 0)
    loaded_base = run.tensor(conj_op.id, "input", 0)
    assert _same_bits(loaded_conj, traced["conj"]) and _same_bits(loaded_base, traced["conj"].conj())
    assert not _same_bits(loaded_conj, loaded_base)  # never read back as its base
    # One storage, one blob: the view's bit tells the two apart.
    assert dump.entries[(conj_op.index, "output", 0)].blob == dump.entries[(conj_op.index, "input", 0)].blob

    mul = next(op for op in _ops(run, "aten.mul.Tensor") if op.inputs[0].dtype == "complex64"
               and _same_bits(run.tensor(op.id, "output", 0), traced["conj_times_2"]))
    assert _same_bits(run.tensor(mul.id, "input", 0), traced["conj"])

    outputs = [run.tensor(op.id, "output", 0) for op in run.ops(0) if op.outputs]
    assert any(_same_bits(t, traced["ihfft"]) and t.is_conj() for t in outputs)
    assert any(_same_bits(t, traced["ifft"]) for t in outputs)

    (neg_op, _) = _ops(run, "aten._neg_view.default")
    assert _same_bits(run.tensor(neg_op.id, "output", 0), traced["neg"])
    (add,) = _ops(run, "aten.add.Tensor")
    assert _same_bits(run.tensor(add.id, "input", 0), traced["neg"])
    assert _same_bits(run.tensor(add.id, "output", 0), traced["neg_plus_1"])

    # Checksums are of the values a view holds: the conj view's differs from its base's.
    entries = dump.entries
    assert entries[(conj_op.index, "output", 0)].checksum != entries[(conj_op.index, "input", 0)].checksum


# -- tensors without plain bytes ---------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_inference_sparse_nested_and_zero_tensors_are_recorded_without_crashing(tmp_path):
    dense = torch.randn(3, 3)
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with probe.mode("dump", out=tmp_path / "r") as session:
        with torch.inference_mode():
            doubled = torch.ones(3).mul(2.0)
            doubled.add_(1.0)
        sparse = dense.to_sparse().mul(2.0)
        nested_twice = nested.mul(2.0)
        zeros = aten._efficientzerotensor.default([2, 3])
        after = torch.ones(2).add(1.0)
        session.step()
    assert torch.equal(doubled, torch.full((3,), 3.0))
    assert torch.equal(sparse.to_dense(), dense * 2)
    assert torch.equal(nested_twice.unbind()[1], nested.unbind()[1] * 2)
    assert zeros.shape == (2, 3)

    run = probe.load(tmp_path / "r")
    entries = run.dump(0).entries.values()
    assert "not dumpable: inference" in {entry.status for entry in entries}
    # Sparse, nested and zero tensors are stored in parts (tests/test_dump_layouts.py).
    assert {"sparse_coo", "nested", "zero"} <= {entry.layout for entry in entries if entry.status is None}
    add_ = next(op for op in run.ops(0) if op.name == "aten.add_.Tensor")
    with pytest.raises(ProbeError, match="not dumpable: inference"):
        run.tensor(add_.id, "output", 0)
    (add,) = _ops(run, "aten.add.Tensor")
    assert torch.equal(run.tensor(add.id, "output", 0), after)


# -- a full disk -----------------------------------------------------------------------


def _disk_of(monkeypatch, capacity: int) -> dict[str, int]:
    """The shard writer's low-level write fails with ENOSPC once ``capacity`` bytes are written."""
    real = shards._write_fully
    disk = {"used": 0, "capacity": capacity}

    def write(fd, data):
        size = data.nbytes
        if disk["used"] + size > disk["capacity"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        disk["used"] += size
        real(fd, data)

    monkeypatch.setattr(shards, "_write_fully", write)
    return disk


def test_a_disk_filling_up_mid_dump_loses_those_shards_and_training_goes_on(tmp_path, monkeypatch):
    torch.manual_seed(0)
    plain = train_steps(SharedBlockNet(), 3, seed=1)
    big = torch.randn(1024, 1024)  # 4 MiB: streamed in pieces under a 1 MiB budget
    disk = _disk_of(monkeypatch, 3 * MiB)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with pytest.warns(ProbeWarning, match="No space left"), \
            probe.mode("dump", out=tmp_path / "r", memory_budget=1 * MiB) as session:
        big.mul(2.0)  # the disk fills up in the middle of this tensor
        losses, grads = train_steps(model, 3, session=session, seed=1)
        disk["capacity"] = 1 << 40  # space again: later steps are whole
        big.add(1.0)
        session.step()
    assert losses == plain[0] and all(torch.equal(grads[k], plain[1][k]) for k in grads)

    run = probe.load(tmp_path / "r")
    assert not run.dump(0).complete
    lost = [e for e in run.dump(0).entries.values() if e.status and e.status.startswith("lost")]
    assert lost and all("No space left" in e.status for e in lost)
    mul = next(op for op in _ops(run, "aten.mul.Tensor", 0) if op.outputs[0].shape == (1024, 1024))
    with pytest.raises(ProbeError, match="No space left"):
        run.tensor(mul.id, "output", 0)
    assert run.step_info(0).manifest["modes"]["dump"]["lost"] > 0
    last = run.steps[-1]
    assert run.dump(last).complete
    (add,) = _ops(run, "aten.add.Tensor", last)
    assert _same_bits(run.tensor(add.id, "output", 0, step=last), big + 1.0)
    # No temporary shard is left behind.
    assert not list((tmp_path / "r").rglob("*.tmp"))


def test_a_full_disk_with_on_error_raise_stops_training_with_a_probe_error(tmp_path, monkeypatch):
    _disk_of(monkeypatch, 0)
    steps_ended = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(ProbeError, match="No space left"), \
                probe.mode("dump", out=tmp_path / "r", on_error="raise", memory_budget=1 * MiB) as session:
            for _ in range(3):
                torch.randn(1024, 1024).mul(2.0)  # streamed: the writer fails while ops still copy
                session.step()
                steps_ended.append(session.step_index)
    # The failure stops training at the first step's end, with its cause: not from inside an op,
    # where the dump mode would be detached as failed and the interrupted copies named instead.
    assert steps_ended == []
    assert not [w for w in said if "mode failed" in str(w.message)]


def test_any_failure_of_the_shard_writer_loses_the_shard_not_the_writer(tmp_path, monkeypatch):
    real = shards.write_shard
    failures = {"left": 1}

    def failing_once(path, arena, metadata):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("device error while copying")
        return real(path, arena, metadata)

    monkeypatch.setattr(shards, "write_shard", failing_once)
    with probe.mode("dump", out=tmp_path / "r") as session:
        torch.ones(4).add(1.0)
        session.step()
        torch.ones(4).add(2.0)
        session.step()
    run = probe.load(tmp_path / "r")
    assert not run.dump(0).complete and run.dump(1).complete
    (add,) = _ops(run, "aten.add.Tensor", 1)
    assert torch.equal(run.tensor(add.id, "output", 0, step=1), torch.full((4,), 3.0))


# -- names -------------------------------------------------------------------------------


def test_shard_and_blob_names_in_the_index_are_plain_file_names(tmp_path):
    with probe.mode("dump", out=tmp_path / "r", shard_size=4096, memory_budget=1 * MiB) as session:
        torch.randn(512, 512).mul(2.0)  # streamed
        for _ in range(4):
            torch.randn(32, 32).exp()
        session.step()
    index = _index(tmp_path / "r")
    names = list(index["shards"]) + [name for pair in index["blobs"].values() for name in pair]
    assert len(index["shards"]) > 2
    for name in names:
        assert name == Path(name).name and "/" not in name and "\\" not in name
        assert not name.startswith(".") and name not in ("", "..")


def test_a_large_copy_interrupted_midway_leaves_no_partial_shard(tmp_path, monkeypatch):
    real = shards._copy_into
    pieces = {"n": 0}

    def interrupted(view, arena, source, on_device):
        pieces["n"] += 1
        if pieces["n"] == 3:
            raise KeyboardInterrupt
        real(view, arena, source, on_device)

    big = torch.randn(1024, 1024)
    monkeypatch.setattr(shards, "_copy_into", interrupted)
    with pytest.raises(KeyboardInterrupt), \
            probe.mode("dump", out=tmp_path / "r", memory_budget=1 * MiB, tensors="outputs"):
        torch.ones(4).add(1.0)
        big.mul(2.0)  # streamed in 512 KiB pieces: Ctrl-C at the third
    monkeypatch.setattr(shards, "_copy_into", real)
    assert pieces["n"] == 3
    assert not list((tmp_path / "r").rglob("*.tmp"))
    run = probe.load(tmp_path / "r")
    (add,) = _ops(run, "aten.add.Tensor")
    assert torch.equal(run.tensor(add.id, "output", 0), torch.full((4,), 2.0))
