"""Dump mode: tensors to safetensors shards, exact round trips, failures that lose nothing else."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors import safe_open

import probe
from probe import ProbeError
from probe.modes.dump import shards
from probe.modes.dump.file_names import tensors_dir
from probe.rundir.call_args import decode_args
from tests.conftest import SharedBlockNet, train_steps, train_under

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def _make(dtype: torch.dtype, shape=(6, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_every_dtype_and_layout_round_trips_bitwise_with_its_strides(tmp_path):
    aten = torch.ops.aten
    produced = []
    with probe.mode("dump", out=tmp_path / "r"):
        for dtype in DTYPES:
            base = aten.clone.default(_make(dtype))
            produced += [
                base,
                aten.t.default(base),                              # non-contiguous view
                aten.slice.Tensor(base, 0, 1, 5, 2),               # strided slice with an offset
                aten.as_strided.default(base, (6, 7), (5, 0), 2),  # stride-0 broadcast
                aten.zeros.default([0, 5], dtype=dtype),           # zero-size
            ]
    run = probe.load(tmp_path / "r")
    ops = [op for op in run.ops(0) if op.name != "aten.randn.default"]
    ops = [op for op in ops if op.name in ("aten.clone.default", "aten.t.default", "aten.slice.Tensor",
                                           "aten.as_strided.default", "aten.zeros.default")]
    ops = [op for op in ops if not (op.name == "aten.clone.default" and op.inputs[0].source is None
                                    and False)]
    kept = [op for op in ops if op.outputs[0].dtype in {str(d).removeprefix("torch.") for d in DTYPES}]
    assert len(kept) == len(produced)
    for op, original in zip(kept, produced, strict=True):
        loaded = run.tensor(op.id, "output", 0)
        assert _bitwise_equal(loaded, original), (op.id, original.dtype)
        if original.numel():
            assert loaded.stride() == original.stride(), op.id


def test_each_storage_is_written_once_per_step_and_inplace_values_are_kept(tmp_path):
    with probe.mode("dump", out=tmp_path / "r") as session:
        w = torch.ops.aten.clone.default(torch.randn(64, 64))
        x = torch.ones(4, 64)
        a = x @ w      # w read
        b = x @ w.t()  # w read again through a view
        w.mul_(2.0)    # in place: a new value of the same storage
        c = x @ w
        session.step()
    run = probe.load(tmp_path / "r")
    ops = {op.name: op for op in run.ops(0)}
    dump = run.dump(0)
    mms = [op for op in run.ops(0) if op.name == "aten.mm.default"]
    blobs_of_w = {dump.entries[(op.index, "input", 1)].blob for op in mms}
    # w before the write is one blob (read twice, once through a view); w after is another.
    assert len(blobs_of_w) == 2
    before = run.tensor(mms[0].id, "input", 1)
    after = run.tensor(mms[2].id, "input", 1)
    assert torch.equal(after, before * 2.0)
    mul = ops["aten.mul_.Tensor"]
    assert torch.equal(run.tensor(mul.id, "input", 0), before)  # captured before the op ran
    assert torch.equal(run.tensor(mul.id, "output", 0), after)
    assert torch.equal(run.tensor(mms[1].id, "output", 0), b)
    del a, c


def test_training_is_bitwise_identical_with_the_dump(tmp_path):
    plain = train_under(lambda m: None, seed=7)
    dumped = train_under(
        lambda m: probe.mode(["stats", "dump"], out=tmp_path / "r", model=m, checksum=True), seed=7
    )
    assert all(torch.equal(a, b) for a, b in zip(plain[0], dumped[0], strict=True))
    assert all(torch.equal(plain[1][k], dumped[1][k]) for k in plain[1])
    assert torch.equal(plain[3], dumped[3])
    run_dir = probe.load(tmp_path / "r")
    assert run_dir.steps == [0, 1] and run_dir.dump(1).complete


def test_filters_write_exactly_the_selected_tensors(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("dump", out=tmp_path / "r", model=model, ops=["addmm"], modules=["head"],
                    steps=[1], tensors="outputs") as session:
        train_steps(model, 2, session=session)
    run = probe.load(tmp_path / "r")
    assert run.steps == [1]
    ops = run.ops(1)
    assert [(op.name, op.module) for op in ops] == [("aten.addmm.default", "head")]
    assert list(run.dump(1).entries) == [(0, "output", 0)]
    shard_dir = tensors_dir(tmp_path / "r", 0, 1)
    assert [p.name for p in shard_dir.iterdir()] == ["shard-00000.safetensors"]
    assert not tensors_dir(tmp_path / "r", 0, 0).exists()
    with pytest.raises(ProbeError, match="was not dumped"):
        run.tensor(ops[0].id, "input", 0, step=1)


def test_shards_are_plain_safetensors_files_of_bounded_size(tmp_path):
    with probe.mode("dump", out=tmp_path / "r", shard_size=4096, tensors="outputs") as session:
        for _ in range(20):
            torch.randn(32, 32).exp()  # 4 KiB per result
        session.step()
    shard_dir = tensors_dir(tmp_path / "r", 0, 0)
    files = sorted(shard_dir.iterdir())
    assert len(files) >= 10
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += f.get_tensor(key).numel()
    assert total >= 40 * 32 * 32 * 4


def test_a_full_disk_marks_the_step_incomplete_and_training_goes_on(tmp_path, monkeypatch):
    real = shards.write_shard
    calls = {"n": 0}

    def failing(path, blobs, metadata):
        if "step1" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        calls["n"] += 1
        return real(path, blobs, metadata)

    monkeypatch.setattr(shards, "write_shard", failing)
    torch.manual_seed(0)
    model = SharedBlockNet()
    with pytest.warns(UserWarning, match="could not write"), \
            probe.mode("dump", out=tmp_path / "r", model=model) as session:
        losses, _ = train_steps(model, 3, session=session)
    assert len(losses) == 3  # training went on
    run = probe.load(tmp_path / "r")
    assert run.steps == [0, 1, 2]
    assert run.dump(0).complete and run.dump(2).complete
    assert not run.dump(1).complete
    op = run.ops(1)[3]
    with pytest.raises(ProbeError, match="No space left"):
        run.tensor(op.id, "output", 0, step=1)
    assert run.step_info(1).manifest["modes"]["dump"]["lost"] > 0
    # The steps around it are whole.
    assert run.tensor(run.ops(2)[3].id, "output", 0, step=2).numel() > 0


def test_on_error_raise_stops_training_with_a_clear_error(tmp_path, monkeypatch):
    def failing(path, blobs, metadata):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(shards, "write_shard", failing)
    with pytest.raises(ProbeError, match="Permission denied"), \
            probe.mode("dump", out=tmp_path / "r", on_error="raise") as session:
        torch.randn(8).exp()
        session.step()
        torch.randn(8).exp()
        session.step()


def test_memory_budget_waits_or_skips(tmp_path):
    with probe.mode("dump", out=tmp_path / "w", memory_budget=8192, shard_size=4096,
                    tensors="outputs") as session:
        results = [torch.randn(32, 32).exp() for _ in range(10)]
        session.step()
    run = probe.load(tmp_path / "w")
    exps = [op for op in run.ops(0) if op.name == "aten.exp.default"]
    assert all(torch.equal(run.tensor(op.id), r) for op, r in zip(exps, results, strict=True))

    with probe.mode("dump", out=tmp_path / "s", memory_budget=1, on_budget="skip",
                    tensors="outputs", async_flush=False) as session:
        for _ in range(5):
            torch.randn(64, 64).exp()
        session.step()
    run = probe.load(tmp_path / "s")
    statuses = [e.status for e in run.dump(0).entries.values()]
    assert any(s == "skipped: memory budget" for s in statuses)
    assert run.step_info(0).manifest["modes"]["dump"]["skipped"] > 0


def test_checksums_match_for_identical_runs_and_differ_for_a_changed_bit(tmp_path):
    def exp_checksums(out, flip):
        torch.manual_seed(3)
        x = torch.randn(1000)
        if flip:
            x.view(torch.int32)[123] ^= 1  # one bit of one element
        with probe.mode("dump", out=out, checksum=True):
            x.exp()
        run = probe.load(out)
        (op,) = run.ops(0)
        entries = run.dump(0).entries
        return entries[(op.index, "input", 0)].checksum, entries[(op.index, "output", 0)].checksum

    a, b, c = exp_checksums(tmp_path / "a", False), exp_checksums(tmp_path / "b", False), \
        exp_checksums(tmp_path / "c", True)
    assert a == b and all(isinstance(v, int) for v in a)
    assert a[0] != c[0]


def test_a_dumped_op_reexecutes_exactly_from_its_recorded_call(tmp_path):
    torch.manual_seed(0)
    model = SharedBlockNet()
    with probe.mode("dump", out=tmp_path / "r", model=model) as session:
        train_steps(model, 1, session=session)
    run = probe.load(tmp_path / "r")
    dump = run.dump(0)
    checked = 0
    for op in run.ops(0):
        if op.name not in ("aten.addmm.default", "aten.gelu_backward.default", "aten.sum.dim_IntList",
                           "aten._log_softmax.default", "aten.addcdiv_.default"):
            continue
        def dumped_input(i, op=op):
            return run.tensor(op.id, "input", i).clone()

        args, kwargs = decode_args(dump.call(op.index), dumped_input)
        func = torch.ops.aten
        for part in op.name.split(".")[1:]:
            func = getattr(func, part)
        out = func(*args, **kwargs)
        assert torch.equal(out, run.tensor(op.id, "output", 0)), op.id
        checked += 1
    assert checked >= 5
