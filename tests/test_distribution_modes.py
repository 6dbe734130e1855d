"""Distribution shares, histograms and fp8 scales recorded by the stats mode and the monitor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_models import assert_trained_alike, tiny_llama, train_steps

import probe
from probe.modes.monitor.file_names import MONITOR_DISTRIBUTION_FILE
from probe.modes.stats.file_names import DISTRIBUTION_FILE
from probe.rundir import layout

pytest.importorskip("transformers", reason="transformers is an optional test dependency")


def _expected_shares(t: torch.Tensor) -> list[float | None]:
    """Recomputed in fp64 from the dumped values, against the tensor's own dtype."""
    x = torch.view_as_real(t) if t.is_complex() else t
    w = x.double().abs().reshape(-1)
    zeros = (w == 0).sum().item() / w.numel()
    if not x.is_floating_point():
        return [zeros, None, None]
    info = torch.finfo(x.dtype)
    return [zeros, ((w > 0) & (w < info.tiny)).sum().item() / w.numel(),
            ((w > info.max / 2) & w.isfinite()).sum().item() / w.numel()]


def test_llama_shares_match_the_dumped_values_and_training_is_unchanged(tmp_path):
    plain_model = tiny_llama()
    plain = train_steps(plain_model)
    rng = torch.get_rng_state()
    model = tiny_llama()
    with probe.mode(["stats", "dump"], out=tmp_path / "r", model=model, distribution=True,
                    histogram=True) as session:
        traced = train_steps(model, session)
    assert_trained_alike(plain_model, plain, model, traced, rng)

    run = probe.load(tmp_path / "r")
    checked = with_zeros = 0
    for op in run.ops(1):
        for position, out in enumerate(op.outputs):
            if out.stats is None or out.numel == 0:
                assert out.distribution is None
                continue
            d = out.distribution
            assert d is not None and set(d) == {"zeros", "underflow", "near_overflow"}
            assert all(v is None or 0 <= v <= 1 for v in d.values())
            t = run.tensor(op.id, "output", position, step=1)
            got = [d["zeros"], d["underflow"], d["near_overflow"]]
            assert got == pytest.approx(_expected_shares(t)), op.id
            if out.floating:
                h = out.histogram
                assert h["zero"] + h["nonfinite"] + sum(h["exponents"].values()) == out.numel
            else:
                assert out.histogram is None and d["underflow"] is None
            checked += 1
            with_zeros += d["zeros"] > 0
    assert checked > 100 and with_zeros > 0  # ReLU-free Llama still has zeros: masks, embeddings' grads
    # The finfo.min causal mask is near overflow, in fp32.
    masks = [op for op in run.ops(1) for out in op.outputs
             if out.distribution and out.distribution["near_overflow"] and out.dtype == "float32"]
    assert masks


def test_bf16_shares_and_a_run_without_the_option(tmp_path):
    x = torch.zeros(64, dtype=torch.bfloat16)
    x[:8] = 1e-39  # subnormal in bf16
    x[8:12] = 3e38  # near bf16's max
    x[12:32] = 1.0
    with probe.mode("stats", out=tmp_path / "on", distribution=True) as session:
        y = x * 1
        session.step()
    with probe.mode("stats", out=tmp_path / "off") as session:
        y = x * 1
        session.step()
    assert y.dtype == torch.bfloat16
    (op,) = [op for op in probe.load(tmp_path / "on").ops(0) if op.name == "aten.mul.Tensor"]
    assert op.outputs[0].distribution == {"zeros": 32 / 64, "underflow": 8 / 64, "near_overflow": 4 / 64}
    assert op.outputs[0].histogram is None
    (op,) = [op for op in probe.load(tmp_path / "off").ops(0) if op.name == "aten.mul.Tensor"]
    assert op.outputs[0].distribution is None and op.outputs[0].stats is not None
    assert not (tmp_path / "off" / "rank0" / "step0" / DISTRIBUTION_FILE).exists()


def test_version_one_runs_still_load(tmp_path):
    with probe.mode("stats", out=tmp_path / "r") as session:
        torch.ones(3).mul(2)
        session.step()
    for path in [tmp_path / "r" / layout.RUN_FILE, tmp_path / "r" / "rank0" / "step0" / layout.MANIFEST_FILE]:
        info = json.loads(path.read_text())
        assert info["format_version"] == layout.FORMAT_VERSION >= 2
        path.write_text(json.dumps({**info, "format_version": 1}))
    (op,) = [op for op in probe.load(tmp_path / "r").ops(0) if op.name == "aten.mul.Tensor"]
    assert op.outputs[0].stats["max"] == 2.0 and op.outputs[0].distribution is None
    assert op.fp8_scales is None


def test_scaled_mm_records_its_scales(tmp_path):
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = torch.tensor(0.25), torch.tensor(8.0)
    with probe.mode("stats", out=tmp_path / "r", distribution=True) as session:
        out = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)
        scale_a.mul_(4)  # delayed scaling updates the scale afterwards: the op's value is kept
        session.step()
    reference = (a.float() * 0.25) @ (b.float() * 8.0)
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)
    run = probe.load(tmp_path / "r")
    (op,) = [op for op in run.ops(0) if op.name == "aten._scaled_mm.default"]
    assert op.fp8_scales == {
        "scale_a": {"shape": [], "values": [0.25], "min": 0.25, "max": 0.25},
        "scale_b": {"shape": [], "values": [8.0], "min": 8.0, "max": 8.0},
    }
    # the fp8 operand's shares are against float8_e4m3fn's range
    (cast,) = [o for o in run.ops(0) if o.name == "aten.mul_.Tensor"]
    assert cast.fp8_scales is None
    assert np.isclose(op.outputs[0].distribution["zeros"], (out == 0).float().mean().item())


def test_monitor_series_shares_histograms_and_tensorboard(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    seen: dict[tuple[str, int], torch.Tensor] = {}
    model = tiny_llama()
    plain_model = tiny_llama()
    calls: dict[str, int] = {}

    def capture(name):
        def hook(module, args, out):
            call = calls.get(name, 0)
            calls[name] = call + 1
            seen[(name, call)] = out.detach().clone()
        return hook

    for name in ("model.layers.0.mlp", "model.norm"):
        model.get_submodule(name).register_forward_hook(capture(name))
    with probe.mode("monitor", out=tmp_path / "r", model=model, targets=["model.layers.0.mlp", "model.norm"],
                    histogram=True, mv_distribution=True, tensorboard=True) as session:
        traced = train_steps(model, session, steps=1)
    assert torch.equal(traced[0], train_steps(plain_model, steps=1)[0])
    run = probe.load(tmp_path / "r")
    series = run.monitor(0)
    outputs = [m for m in series if m.kind == "activation" and m.slot == "output"]
    assert {m.name for m in outputs} == {"model.layers.0.mlp", "model.norm"}
    for m in outputs:
        t = seen[(m.name, m.call)]
        assert [m.distribution[k] for k in ("zeros", "underflow", "near_overflow")] == \
            pytest.approx(_expected_shares(t))
        h = m.histogram
        assert h["zero"] + h["nonfinite"] + sum(h["exponents"].values()) == t.numel()
        w = t.double().abs()
        assert max(h["exponents"]) == int(torch.floor(torch.log2(w.max())))
    moments = [m for m in series if m.kind == "exp_avg_sq"]
    assert moments and all(m.distribution is not None for m in moments)
    events = event_accumulator.EventAccumulator(str(tmp_path / "r" / "rank0" / "tensorboard"))
    events.Reload()
    assert "activation/model.norm/output/log2_magnitude" in events.Tags()["histograms"]
    (zeros,) = events.Scalars("activation/model.norm/output/zeros_share")
    norm = next(m for m in outputs if m.name == "model.norm")
    assert zeros.value == pytest.approx(norm.distribution["zeros"])
    (hist,) = events.Histograms("activation/model.norm/output/log2_magnitude")
    assert hist.histogram_value.num == sum(norm.histogram["exponents"].values())


def test_monitor_without_the_option_has_no_distribution(tmp_path):
    model = tiny_llama()
    with probe.mode("monitor", out=tmp_path / "r", model=model, targets=["model.norm"]) as session:
        train_steps(model, session, steps=1)
    series = probe.load(tmp_path / "r").monitor(0)
    assert series and all(m.distribution is None and m.histogram is None for m in series)
    assert not (tmp_path / "r" / "rank0" / "step0" / MONITOR_DISTRIBUTION_FILE).exists()


@pytest.mark.parametrize("option", ["distribution", "histogram"])
def test_no_host_sync_inside_a_step(tmp_path, option):
    from tests.conftest import SharedBlockNet
    from tests.test_no_host_sync import SyncSentinel

    torch.manual_seed(0)
    model = SharedBlockNet()
    sentinel = SyncSentinel()
    session = probe.mode("stats", out=tmp_path / "r", model=model, inputs=True, **{option: True})
    with sentinel, session:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        model(x).square().mean().backward()
        torch.optim.SGD(model.parameters(), lr=1e-2).step()
        syncs_in_step = list(sentinel.syncs)
        session.step()
    assert syncs_in_step == [] and sentinel.device_to_host == []
    ops = probe.load(tmp_path / "r").ops(0)
    assert sum(out.distribution is not None for op in ops for out in op.outputs) > 10
