"""The statistics engine's accelerator path against issue 35's budget, on the CPU
(``benchmarks.device_cost``: the engine's ops on ``meta`` tensors, counted)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cost_model, device_cost
from probe.modes.statistics.capture import STAGE_MAX_NUMEL


@pytest.mark.parametrize("multi_tensor", [True, False], ids=["triton", "no-triton"])
def test_stats_engine_reads_each_value_once_and_writes_no_copy_on_the_accelerator_path(multi_tensor):
    # One step of hf-llama-small's shapes (one layer), as the stats mode hands its tensors over.
    tally = cost_model.model_tally("hf-llama-small-1layer", multi_tensor=multi_tensor)
    assert tally.values > 100 and tally.value_bytes > 64 << 20
    read, written, _, syncs = device_cost.budgets(tally)
    assert read.met, (read, tally.by_op())  # a widened, contiguous or negated copy reads again
    assert written.met, (written, tally.by_op())  # ... and writes what it copies
    assert syncs.met, tally.by_op()
    if multi_tensor:
        # CUDA with Triton: a queued batch is one multi-tensor call (three launches), whatever
        # its size; what is left per tensor is a staging copy of a value no batch takes (an
        # integer, a strided view). One launch per tensor again (the compiled pass per tensor,
        # a staging copy per small float tensor) fails here.
        assert tally.launches <= tally.values / 8, tally.by_op()
    else:
        # Without it, one kernel per tensor (the compiled pass, or the staging copy); beyond
        # that only a few per step (the threshold constant, a stack per queued batch and staging
        # chunk): a second launch per tensor (a constant made per call, an eager pass) fails here.
        assert tally.launches - tally.values <= 16, tally.by_op()


def test_counter_sees_a_widening_copy_the_engine_makes_inside_an_op():
    mode = device_cost.DeviceCostMode()
    x = torch.empty(1 << 10, device="meta", dtype=torch.bfloat16)

    def engine_reads_x(func, args, kwargs):
        if func is torch.ops.aten.add_.Tensor:  # a program's op: the engine runs inside its dispatch
            with mode.engine():
                x.double().sum()

    y = torch.empty(1, device="meta")
    mode.before_op = engine_reads_x
    with mode:
        y.add_(torch.ones_like(y))
    mode.before_op = None
    assert [(op.name, op.read, op.written) for op in mode.tally.ops] == [
        ("_to_copy", 2 << 10, 8 << 10), ("sum", 8 << 10, 8)]


# What a real stats session may issue on the device: the engine's one fused pass per value
# (``TensorStats.row``) or, on CUDA with Triton, one multi-tensor call per batch
# (``_multi_tensor_block``), and the staging copy of a small value into its chunk
# (``StageChunk.add``). Anything else per value (a snapshot copy of a value about to be written
# in place, a widened or contiguous copy, a cast inside a reduction, a stack per queued batch)
# is a new (op, issuing function) here.
SESSION_OPS = {("compiled _fused_raw", "row"), ("copy_", "add"), ("multi-tensor rows", "_multi_tensor_block")}


@pytest.mark.parametrize("multi_tensor", [True, False], ids=["triton", "no-triton"])
@pytest.mark.parametrize("optimizer", device_cost.OPTIMIZERS)
def test_a_stats_session_reduces_each_value_in_one_launch_and_copies_only_staged_values(
        optimizer, multi_tensor):
    # probe.mode("stats") over a step of hf-llama-small's shapes (one layer) on the accelerator
    # path, AdamW foreach or fused: every op the probe issued, with its caller.
    tally = cost_model.session_tally("hf-llama-small-1layer", optimizer, multi_tensor=multi_tensor)
    assert tally.values > 100 and tally.value_bytes > 64 << 20
    issued = {(op.name, op.issuer) for op in tally.ops}
    assert issued <= SESSION_OPS, tally.by_caller()
    # A staging copy writes one small value (into an fp32 chunk, fp64 for fp64 values): a copy
    # of a larger value is a copy of a value the engine reduces.
    for op in tally.ops:
        if op.name == "copy_":
            assert op.written <= STAGE_MAX_NUMEL * 8, op
    if multi_tensor:
        # The inputs a foreach op writes are reduced in one batch before it (StepRows.hold), and
        # small values join a batch instead of a staging copy each: a launch per value again (the
        # optimizer's 32 reads one by one, a staging copy per activation or integer) fails here.
        # (Measured: 36 launches for 344 values with foreach, 27 for 295 fused; 344 before.)
        assert tally.launches <= tally.values / 8, tally.by_caller()
    else:
        # One launch per value at most (its pass or its staging copy; a value read again, a
        # weight read by several ops, reuses its row).
        assert tally.launches <= tally.values, tally.by_caller()
    read, written, _, syncs = device_cost.budgets(tally)
    assert read.met and written.met and syncs.met, (read, written, syncs, tally.by_caller())


def test_sketches_are_taken_in_the_statistics_read_where_the_multi_tensor_kernel_runs():
    # probe.Stats(sketch=True) on the accelerator path with Triton: the queued values' sketches
    # come from the same multi-tensor call as their statistics (signs given to the call), q and k
    # after their transpose too (read in storage order, each value signed as its logical place);
    # only a value read at once (a view about to be written) would have a call of its own, and
    # this step has none: the launches are the statistics' own. Before: a sketch per value by
    # matrix products on a widened copy, read 3.1x, written 0.035x, 1,393 launches; a separate
    # sketch pass per batch, read 2.0x; a call of their own for the transposed heads, 81 launches.
    plain = cost_model.session_tally("hf-llama-small-1layer", "foreach")
    tally = cost_model.session_tally("hf-llama-small-1layer", "foreach", sketch=True)
    assert tally.values == plain.values and tally.value_bytes == plain.value_bytes
    issued = {(op.name, op.issuer) for op in tally.ops}
    assert issued <= SESSION_OPS, tally.by_caller()
    read, written, _, syncs = device_cost.budgets(tally)
    assert read.met and written.met and syncs.met, (read, written, syncs, tally.by_caller())
    alone = [op for op in tally.ops if "> _by_kernel >" in op.caller]
    assert not alone, tally.by_caller()
    assert tally.launches == plain.launches, tally.by_caller()
