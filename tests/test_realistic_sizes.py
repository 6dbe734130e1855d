"""Realistic sizes: HF models at hidden 256, batch 4 x 128, vocabulary 4096, AdamW, in every mode.

The tiny models of the other tests never open the statistics engine's batching paths: tensors
above 2^20 elements, queued reductions, flushes at the queue's byte budget. A crash lived there
(``Can't call numpy() on Tensor that requires grad``: the stats mode on an HF Llama of hidden 256,
batch 4 x 128, eager attention) that no test reached. Here the logits alone are
4 x 128 x 4096 = 2^21 elements, and each step traces about 900 ops.

Each run: trains to the end with no probe warning, leaves a run directory ``probe.load`` and
``probe summary`` read, and in the passive modes trains bit for bit as the plain run did (losses,
final weights, torch's RNG). The stats mode's record of the logits (the lm_head's matmul) equals
an fp64 recomputation of the same tensor, captured by a forward hook in the plain run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import assert_trained_alike

import probe
from probe.cli import main as cli_main
from probe.errors import ProbeWarning

transformers = pytest.importorskip("transformers", reason="transformers is an optional test dependency")

VOCAB, BATCH, SEQ, STEPS = 4096, 4, 128, 3
LOGITS_NUMEL = BATCH * SEQ * VOCAB
assert LOGITS_NUMEL > 2**20


def llama(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation=attn,
    ))


def gpt2(attn: str) -> torch.nn.Module:
    """GPT-2 keeps its dropout (0.1): the probed run must draw the same random numbers."""
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=2, n_head=4, attn_implementation=attn,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    ))


FAMILIES = {"llama": llama, "gpt2": gpt2}


def train(model: torch.nn.Module, session: Any = None, steps: int = STEPS,
          autocast: torch.dtype | None = None) -> list[torch.Tensor]:
    """AdamW steps on seeded random batches of 4 x 128 tokens (the forward under CPU autocast to
    ``autocast`` when given); the detached losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if session is not None:
            session.step()
    return losses


@dataclass
class Plain:
    model: torch.nn.Module
    losses: list[torch.Tensor]
    rng: torch.Tensor
    lm_head: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """The lm_head's input, weight and output (the logits) in each step, as the plain run had them."""


@functools.cache
def plain(family: str, attn: str, steps: int = STEPS, autocast: torch.dtype | None = None) -> Plain:
    """The run without the probe (computed once per configuration), with the lm_head's tensors of
    each step taken by a forward hook."""
    model = FAMILIES[family](attn)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def keep(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen.append((args[0].detach().clone(), module.weight.detach().clone(), out.detach().clone()))

    hook = model.lm_head.register_forward_hook(keep)
    losses = train(model, steps=steps, autocast=autocast)
    rng = torch.get_rng_state()
    hook.remove()
    return Plain(model, losses, rng, seen)


def probed(out: Path, modes: str | list[str], family: str, attn: str, steps: int = STEPS,
           autocast: torch.dtype | None = None, **options: Any) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A fresh model trained under ``probe.mode(modes, ...)``; no warning from the probe on the way
    (``warnings``, nor a log record of WARNING or above from a ``probe`` logger)."""
    model = FAMILIES[family](attn)
    logged = _Records(level=logging.WARNING)
    logger = logging.getLogger("probe")
    logger.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with probe.mode(modes, out=out, model=model, **options) as session:
                losses = train(model, session, steps, autocast)
    finally:
        logger.removeHandler(logged)
    said = [str(w.message) for w in caught
            if issubclass(w.category, ProbeWarning) or str(w.message).startswith("probe")]
    said += [record.getMessage() for record in logged.records]
    assert not said, said
    return model, losses


class _Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def readable(out: Path, steps: int = STEPS) -> probe.Run:
    run = probe.load(out)
    assert run.steps == list(range(steps)) and run.ranks == [0]
    assert cli_main(["summary", str(out)]) == 0
    return run


def logits_op(run: probe.Run, step: int) -> Any:
    """The forward op that made the logits: the lm_head's matmul, of the logits' element count."""
    found = [op for op in run.ops(step) if op.module == "lm_head" and op.phase == "forward"
             and op.outputs and math.prod(op.outputs[0].shape) == LOGITS_NUMEL]
    assert found, [(op.name, op.module, op.phase) for op in run.ops(step) if op.module == "lm_head"]
    return found[0]


def assert_exact(stats: dict[str, Any], values: torch.Tensor) -> None:
    """min and max exactly, mean and norm within 1e-7 relative of fp64 arithmetic on ``values``."""
    exact = values.double()
    assert stats["min"] == exact.min().item() and stats["max"] == exact.max().item()
    assert stats["nan"] == stats["inf"] == 0
    norm, mean = exact.norm().item(), exact.mean().item()
    assert abs(stats["norm"] - norm) <= 1e-7 * norm, (stats["norm"], norm)
    assert abs(stats["mean"] - mean) <= 1e-7 * abs(mean), (stats["mean"], mean)


def assert_exact_lm_head_stats(run: probe.Run, reference: Plain) -> None:
    """The logits' matmul: its output (2^21 elements) and both inputs, the hidden states and the
    weight (an input from outside the step, recorded by default), as the plain run computed them."""
    for step, (hidden, weight, logits) in enumerate(reference.lm_head):
        op = logits_op(run, step)
        assert op.outputs[0].dtype == str(logits.dtype).removeprefix("torch.")
        assert_exact(op.outputs[0].stats, logits)
        assert [t.shape for t in op.inputs] == [(BATCH * SEQ, hidden.shape[-1]), tuple(weight.t().shape)]
        # Under autocast the matmul reads its own low-precision casts of both.
        assert_exact(op.inputs[0].stats, hidden.to(logits.dtype))
        assert_exact(op.inputs[1].stats, weight.to(logits.dtype))


PASSIVE = ["stats", "structure", "monitor"]


BLOCKS = {"llama": "model.layers.?", "gpt2": "transformer.h.?"}


def _options(mode: str, family: str) -> dict[str, Any]:
    if mode == "monitor":
        layer = {"input": "tuple[1]:0", "output": "tensor",
                 "input_grad": "tuple[1]:0", "output_grad": "tensor"}
        block = BLOCKS[family]
        return dict(targets={block: layer, f"{block}.mlp": layer, "lm_head": layer},
                    wg_distribution=True, mv_distribution=True, param_distribution=True, ur_distribution=True)
    return {}


def _check_passive(tmp_path: Path, mode: str, family: str, attn: str,
                   autocast: torch.dtype | None = None) -> None:
    reference = plain(family, attn, autocast=autocast)
    out = tmp_path / "run"
    modes = mode.split("+")
    model, losses = probed(out, modes if len(modes) > 1 else mode, family, attn, autocast=autocast,
                           **_options(mode, family))
    assert_trained_alike(reference.model, reference.losses, model, losses, reference.rng)

    run = readable(out)
    if mode == "monitor":
        assert run.anomalies() == []
        for step, (_, _, logits) in enumerate(reference.lm_head):
            rows = [r for r in run.monitor(step)
                    if (r.kind, r.name, r.slot) == ("activation", "lm_head", "output")]
            assert len(rows) == 1
            exact = logits.double()
            assert rows[0].norm == pytest.approx(exact.norm().item(), rel=1e-7)
            assert rows[0].min == exact.min().item() and rows[0].max == exact.max().item()
        kinds = {r.kind for r in run.monitor(0)}
        assert kinds >= {"activation", "weight_grad", "weight", "exp_avg", "update"}, kinds
        watched = {r.name for r in run.monitor(0) if r.kind == "activation"}
        block = BLOCKS[family].rstrip("?")
        assert watched == {"lm_head"} | {f"{block}{i}{mlp}" for i in (0, 1) for mlp in ("", ".mlp")}
        return
    for step in run.steps:
        ops = run.ops(step)
        assert len(ops) > 500 and {op.phase for op in ops} == {"forward", "backward", "optimizer"}
        assert logits_op(run, step).outputs[0].shape == (BATCH * SEQ, VOCAB)
        with_stats = [t for op in ops for t in op.outputs if t.stats is not None]
        if "stats" in modes:
            assert len(with_stats) > 500
            assert all(t.stats is not None for op in ops for t in op.outputs
                       if t.floating and op.name not in _UNINITIALIZED), [
                (op.name, op.module) for op in ops for t in op.outputs if t.stats is None]
        else:
            assert not with_stats
    if "stats" in modes:
        assert_exact_lm_head_stats(run, reference)
        assert run.first_nonfinite() is None
    if "dump" in modes:
        for step, (_, _, logits) in enumerate(reference.lm_head):
            dumped = run.tensor(logits_op(run, step).id, "output", 0, step=step)
            assert torch.equal(dumped.reshape(logits.shape), logits)
        shutil.rmtree(out)  # about 1 GB a run


_UNINITIALIZED = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                  "aten.new_empty_strided.default", "aten.new_empty.default"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", PASSIVE)
def test_llama_passive_mode_is_transparent_and_readable(tmp_path, mode, attn):
    _check_passive(tmp_path, mode, "llama", attn)


# The dump writes about 1 GB a run (every op's tensors, 3 steps): dump alone with one attention,
# dump with stats with the other, so each attention is dumped once.
@pytest.mark.parametrize(("mode", "attn"), [("dump", "sdpa"), ("stats+dump", "eager")])
def test_llama_dump_is_transparent_and_readable(tmp_path, mode, attn):
    _check_passive(tmp_path, mode, "llama", attn)


@pytest.mark.parametrize("mode", ["stats", "structure", "monitor"])
def test_gpt2_passive_mode_is_transparent_and_readable(tmp_path, mode):
    _check_passive(tmp_path, mode, "gpt2", "eager")


def test_llama_stats_under_bf16_autocast(tmp_path):
    # The bf16 tensors of autocast (the logits among them, 2^21 elements) take the queue's bf16
    # path: read as int32 pairs of values.
    _check_passive(tmp_path, "stats", "llama", "sdpa", autocast=torch.bfloat16)


def test_llama_free_benchmark_check_is_transparent(tmp_path):
    # Two steps, eager attention only: the check re-runs every op twice in fp64 and compares each
    # output element by element (about 20x a plain step here, 3 steps of both attentions ~2.5 min).
    reference = plain("llama", "eager", steps=2)
    out = tmp_path / "run"
    model, losses = probed(out, "free_benchmark", "llama", "eager", steps=2)
    assert_trained_alike(reference.model, reference.losses, model, losses, reference.rng)
    run = readable(out, steps=2)
    for step in run.steps:
        checks = run.checks(step)
        assert len(checks) > 300
        assert {c.verdict for c in checks} <= {"pass", "fail", "skip"}
        assert sum(c.verdict != "skip" for c in checks) > len(checks) // 2
        assert {c.phase for c in checks} == {"forward", "backward", "optimizer"}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_llama_upcast_to_fp64_trains_close_to_fp64(tmp_path, attn):
    """Upcast changes the run by design: each op computed in fp64 and rounded back to fp32. Step 0's
    loss lands on the fp64 model's loss rounded to fp32, at least as close as the plain run's."""
    reference = plain("llama", attn)
    out = tmp_path / "run"
    _, losses = probed(out, "upcast", "llama", attn, upcast_dtype=torch.float64)
    run = readable(out)
    assert all(len(run.ops(step)) > 500 for step in run.steps)

    model64 = llama(attn).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = model64(input_ids=ids, labels=ids).loss.item()
    assert abs(losses[0].item() - exact) <= abs(reference.losses[0].item() - exact)
    assert losses[0].item() == pytest.approx(exact, rel=2**-23)
    for got, want in zip(losses, reference.losses, strict=True):
        assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=1e-4)
