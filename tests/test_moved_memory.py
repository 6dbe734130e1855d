"""Memory that changes hands outside any op. FSDP2 frees its unsharded parameters after the
forward and reallocates them for the backward (``UntypedStorage.resize_``, which no dispatch
mode sees) while autograd holds views of them; Python frees a tensor and the next one may get
its storage's place. What an op reads is the value at its address now, never one a tensor that
lived there before held."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import _unsafe_preserve_version_counter
from torch.utils._python_dispatch import _disable_current_modes

import probe

SHAPE = (16, 16)


def test_a_view_whose_memory_moved_is_not_the_value_now_at_its_old_address(tmp_path):
    g = torch.Generator().manual_seed(0)
    weight, new = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g) * 3
    elsewhere = torch.empty(SHAPE).untyped_storage()
    old_max = weight.max().item()
    with probe.mode("stats", out=tmp_path / "r"):
        saved = weight.t()  # a view registered at the weight's address, as autograd saves one
        with _disable_current_modes(), _unsafe_preserve_version_counter(weight):
            saved.set_(elsewhere, 0, saved.shape, saved.stride())  # moved, alive: as resize_ moves it
        with _unsafe_preserve_version_counter(weight):
            weight.copy_(new)  # new bytes at the old address, at the old version (FSDP2's copy-out)
        with _disable_current_modes():
            reader = weight.t()  # the view a backward reads: no op made it
        reader * 2.0
    transpose, copy, mul = probe.load(tmp_path / "r").ops(0)
    assert [op.name for op in (transpose, copy, mul)] == ["aten.t.default", "aten.copy_.default",
                                                         "aten.mul.Tensor"]
    assert mul.inputs[0].source == (copy.index, 0)  # what is there now, not the moved view
    # A region of what the copy wrote: no statistics of its own (the copy's result holds
    # them), never the weight's old value.
    assert mul.inputs[0].stats is None and copy.outputs[0].stats["max"] == new.max().item()
    assert transpose.outputs[0].stats["max"] == old_max != new.max().item()


def test_a_freed_tensor_read_from_outside_lends_its_row_to_no_later_one(tmp_path):
    # Each tensor made outside the step, read, then freed: the next one's storage (and its
    # memory) may take the freed one's place, at the same offset, size and version.
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(SHAPE, generator=g) * (k + 1) for k in range(20)]
    with probe.mode("stats", out=tmp_path / "r"):
        for v in values:
            with _disable_current_modes():
                t = v.clone()
            t * 2.0
            del t
    muls = probe.load(tmp_path / "r").ops(0)
    assert [op.inputs[0].stats["max"] for op in muls] == [v.max().item() for v in values]


@pytest.fixture(scope="module")
def emulated_reduce_scatter():
    """A collective whose backend writes its input too, without a version bump and without
    its schema saying so: gloo emulates reduce-scatter by an all-reduce of the input buffer
    (here: the input tripled, its first half copied out)."""
    lib = torch.library.Library("_c10d_functional", "FRAGMENT")
    lib.define("probe_test_reduce_scatter_(Tensor(a!) out, Tensor input) -> ()")

    def run(out: torch.Tensor, input: torch.Tensor) -> None:
        with torch.no_grad():
            input.data.mul_(3.0)  # .data: another version counter, as a backend's write
            out.data.copy_(input.data[: out.numel()])

    lib.impl("probe_test_reduce_scatter_", run, "CPU")
    yield torch.ops._c10d_functional.probe_test_reduce_scatter_
    lib._destroy()


def test_a_buffer_a_collective_writes_unannounced_is_read_after_it_as_it_is_then(
        tmp_path, emulated_reduce_scatter):
    g = torch.Generator().manual_seed(2)
    buffer, out = torch.randn(4096, generator=g), torch.empty(2048)
    before = buffer.clone()
    with probe.mode(["stats", "dump"], out=tmp_path / "r"):
        buffer * 1.0  # the buffer read from outside the step: its row and blob are of the value before
        emulated_reduce_scatter(out, buffer)
        buffer * 2.0  # and after: the tripled values, under the same version
    run = probe.load(tmp_path / "r")
    first, collective, second = run.ops(0)
    assert collective.name.endswith("probe_test_reduce_scatter_.default")
    assert first.inputs[0].stats["max"] == before.max().item()
    assert second.inputs[0].stats["max"] == pytest.approx(3 * before.max().item())
    dump = run.dump(0, 0)
    assert torch.equal(dump.tensor(first.index, "input", 0), before)
    assert torch.equal(dump.tensor(collective.index, "input", 1), before)  # what it was given
    assert torch.equal(dump.tensor(second.index, "input", 0), buffer)
    assert collective.outputs[0].stats["max"] == pytest.approx(3 * before[:2048].max().item())
