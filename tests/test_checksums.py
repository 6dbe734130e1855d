"""The checksums mode: what each step started from (parameters, the model's inputs, RNG states),
recorded with every model= session, without changing training and without a host sync."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from hf_models import tiny_llama

import probe
from probe import ProbeError
from probe.modes.checksums.bit_checksum import ChecksumCache, checksums, hex_checksum
from probe.modes.checksums.files import CHECKSUMS_FILE, step_checksums
from probe.modes.checksums.mode import _Queued, _rng_states
from tests.test_no_host_sync import SyncSentinel

pytest.importorskip("transformers", reason="transformers is an optional test dependency")


def _one(tensor: torch.Tensor) -> str:
    return hex_checksum(int(checksums([tensor], ChecksumCache())[0]))


# -- the checksum itself ------------------------------------------------------------


def test_one_changed_bit_or_moved_row_changes_the_checksum():
    x = torch.randn(16, 33)
    nudged = x.clone()
    nudged[7, 20] = torch.nextafter(nudged[7, 20], torch.tensor(10.0))  # one ulp
    assert _one(x) == _one(x.clone())
    assert _one(nudged) != _one(x)
    assert _one(x.flip(0)) != _one(x)  # permuted rows (a transposed or shuffled weight)
    assert _one(x.to(torch.bfloat16)) != _one(x.to(torch.float16))
    ones, twos = torch.ones(64), torch.full((64,), 2.0)  # an xor of equal values would cancel out
    assert _one(ones) != _one(twos) and _one(torch.ones(64)) != _one(torch.ones(62))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.int8, torch.bool, torch.complex64])
def test_the_checksum_depends_on_values_not_on_layout_or_batching(dtype):
    base = (torch.randn(9, 7, dtype=torch.float64) * 50).to(dtype)
    strided = base.t().contiguous().t()  # same values, other strides
    unaligned = base[:, 1:]  # a slice whose rows start mid-word
    assert _one(strided) == _one(base)
    assert _one(unaligned) == _one(unaligned.contiguous())
    together = checksums([base, unaligned, torch.zeros(0, 3), base[0, 0]], ChecksumCache())
    assert [hex_checksum(int(v)) for v in together] == [_one(base), _one(unaligned), _one(torch.zeros(0, 3)),
                                                       _one(base[0, 0])]


def test_the_checksum_is_exact_integer_arithmetic_whatever_the_threads():
    big = torch.randn(300, 4099)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _one(big)
    finally:
        torch.set_num_threads(threads)
    assert _one(big) == one


# -- the mode -----------------------------------------------------------------------


def _train(out, steps=2, seed=0, **options):
    model = tiny_llama(seed=seed, attention_dropout=0.1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    with probe.mode(options.pop("modes", "stats"), out=out, model=model, **options) as session:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            session.step()
    return model, ids, losses


def test_each_step_records_inputs_and_rng_and_the_first_the_parameters(tmp_path):
    model = tiny_llama(seed=0)
    initial = {name: _one(p) for name, p in model.named_parameters()}
    model, ids, _ = _train(tmp_path / "r")
    run = probe.load(tmp_path / "r")
    first, second = step_checksums(run, 0, 0), step_checksums(run, 1, 0)
    assert first.parameters is not None and second.parameters is None  # once a session by default
    assert {name: t.checksum for name, t in first.parameters.items()} == initial
    assert first.parameters["model.embed_tokens.weight"].shape == (128, 32)
    for step in (first, second):
        (call,) = step.inputs
        assert [(t.name, t.dtype, t.shape) for t in call.tensors] == [("input_ids", "int64", (2, 12)),
                                                                       ("labels", "int64", (2, 12))]
        assert call.tensors[0].checksum == _one(ids)
        assert set(step.rng) == {"torch", "python", "numpy"}
    assert first.rng["torch"] != second.rng["torch"]  # dropout drew in between
    assert run.step_info(0).manifest["modes"]["checksums"] == {"parameters": 21, "buffers": 2, "inputs": 1,
                                                               "rng": ["numpy", "python", "torch"]}
    # The buffers with the parameters (inv_freq is not persistent, not in the state dict: recorded too).
    assert first.buffers is not None and second.buffers is None
    inv_freq = model.model.rotary_emb.inv_freq
    assert first.buffers["model.rotary_emb.inv_freq"].checksum == _one(inv_freq)
    assert set(first.buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


def test_parameters_each_step_and_kinds_are_options(tmp_path):
    _train(tmp_path / "each", checksums=["parameters_each_step", "rng"])
    run = probe.load(tmp_path / "each")
    for step in (0, 1):
        found = step_checksums(run, step, 0)
        assert found.parameters is not None and found.inputs is None and found.rng is not None
    a, b = (step_checksums(run, s, 0).parameters for s in (0, 1))
    assert a["lm_head.weight"].checksum != b["lm_head.weight"].checksum  # the optimizer stepped
    _train(tmp_path / "off", checksums=False)
    assert step_checksums(probe.load(tmp_path / "off"), 0, 0) is None
    assert not list((tmp_path / "off").rglob(CHECKSUMS_FILE))
    with pytest.raises(ProbeError, match="option 'checksums'"):
        probe.mode("stats", out=tmp_path / "bad", checksums=["weights"])


def test_training_stays_bit_identical_and_random_streams_untouched(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    _, _, with_checksums = _train(tmp_path / "a", modes="checksums")
    after = (torch.get_rng_state(), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    _, _, without = _train(tmp_path / "b", checksums=False, modes="structure")
    assert all(torch.equal(x, y) for x, y in zip(with_checksums, without, strict=True))
    assert torch.equal(after[0], torch.get_rng_state()) and after[1:] == (random.random(), np.random.rand())


def test_the_mode_alone_traces_nothing_and_respects_steps(tmp_path):
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128, (1, 8))
    with probe.mode("checksums", out=tmp_path / "r", model=model, steps=[1]) as session:
        assert torch._C._len_torch_dispatch_stack() == 0  # no dispatch mode: no per-op cost
        for _ in range(3):
            model(input_ids=ids)
            session.step()
    run = probe.load(tmp_path / "r")
    assert run.steps == [1] and run.ops(1) == []
    assert step_checksums(run, 1, 0).parameters is not None  # the session's first recorded step
    with pytest.raises(ProbeError, match="needs model="):
        probe.mode("checksums", out=tmp_path / "none")


def test_a_paused_forward_is_not_the_steps_input(tmp_path):
    model = tiny_llama(seed=0)
    train_ids, eval_ids = torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)
    with probe.mode("checksums", out=tmp_path / "r", model=model) as session:
        with session.paused():
            model(input_ids=eval_ids)
        model(input_ids=train_ids)
        session.step()
    (call,) = step_checksums(probe.load(tmp_path / "r"), 0, 0).inputs
    assert call.tensors[0].checksum == _one(train_ids)


def test_no_host_sync_inside_the_step(tmp_path):
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128, (1, 8))
    sentinel = SyncSentinel()
    with sentinel, probe.mode("checksums", out=tmp_path / "r", model=model) as session:
        model(input_ids=ids, labels=ids).loss.backward()
        syncs, ops = list(sentinel.syncs), sentinel.ops
        session.step()
    assert syncs == [] and sentinel.device_to_host == []
    assert ops > 0  # the checksums ran below the sentinel, in its view
    assert step_checksums(probe.load(tmp_path / "r"), 0, 0).parameters


def test_a_damaged_checksums_file_is_a_probe_error_naming_it(tmp_path):
    _train(tmp_path / "r", steps=1, modes="checksums")
    path = tmp_path / "r" / "rank0" / "step0" / CHECKSUMS_FILE
    data = json.loads(path.read_text())
    data["parameters"]["checksums"] = data["parameters"]["checksums"][:-1]
    path.write_text(json.dumps(data))
    with pytest.raises(ProbeError, match=r"checksums\.json"):
        step_checksums(probe.load(tmp_path / "r"), 0, 0)


def test_with_model_it_adds_no_step_of_its_own_and_keeps_the_first_written_ones_parameters(tmp_path):
    model = tiny_llama(seed=0)
    ids = torch.randint(0, 128, (1, 8))
    with probe.mode("monitor", out=tmp_path / "r", model=model, targets=["model.layers.0"], start_step=1,
                    step_interval=2, tensorboard=False) as session:
        for _ in range(4):
            model(input_ids=ids, labels=ids).loss.backward()
            session.step()
    run = probe.load(tmp_path / "r")
    assert run.steps == [1, 3]  # the monitor's schedule, not one step more
    assert step_checksums(run, 1, 0).parameters is not None  # step 0 was not written: step 1 has them
    assert step_checksums(run, 3, 0).parameters is None and step_checksums(run, 3, 0).rng


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_checksums_equal_the_cpus_and_nothing_waits(tmp_path):
    x = torch.randn(33, 65)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        assert _one(x.to(dtype).cuda()) == _one(x.to(dtype))
    model = tiny_llama(seed=0).cuda()
    ids = torch.randint(0, 128, (1, 8), device="cuda")
    on_cpu = {name: _one(p.cpu()) for name, p in model.named_parameters()}
    torch.cuda.set_sync_debug_mode("error")  # what the hook queues, cache misses included: no host sync
    try:
        _Queued.of([*model.named_parameters(), ("ids", ids)], ChecksumCache())
        _rng_states()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with probe.mode("checksums", out=tmp_path / "r", model=model) as session:
        model(input_ids=ids, labels=ids).loss.backward()
        session.step()
    found = step_checksums(probe.load(tmp_path / "r"), 0, 0)
    assert {name: t.checksum for name, t in found.parameters.items()} == on_cpu
    assert "cuda" in found.rng
