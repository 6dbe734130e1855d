"""The diagnosis benchmark: ``probe compare`` tested like a detector, on a generated matrix.

Run from the repository root::

    python -m benchmarks.diagnosis [--quick] [--families llama,bert] [--markdown PATH] [--jobs N]

Every case trains a small Hugging Face transformers model (random weights from a config,
nothing downloaded) twice under the probe, a reference run A in fp32 and a run B, and
compares them with :func:`probe.compare`:

- **healthy pairs**: B differs from A only in its precision policy (bf16 autocast, fp16
  autocast with a ``GradScaler``, a bf16 model) or its thread count. Any divergence
  reported is a false alarm.
- **planted faults**: B carries a bug planted by construction at a chosen module and
  step (a norm computed in bf16, a reduction after a cast to bf16, eps removed, a weight
  element corrupted before step k, the softmax computed without its max in fp16, an
  attention mask off by one, rotary tables rounded to bf16, the loss scaled wrongly),
  alone (an fp32 pair) or on top of a precision change. The answer is right when the
  first divergence names the planted module (or an op inside it) and the planted step.

The matrix is generated from its dimensions (families x attention x vocabulary x steps
x optimizer x mode x pair x fault), not hand-picked; ``--quick`` takes a covering subset
that runs in a few minutes (CI runs it). The table goes to the console and, with
``--markdown``, to ``benchmarks/results/diagnosis.md``. Targets: 0 false divergences over
the healthy pairs, >= 95% of faults at the right module and step.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

HIDDEN, HEADS, LAYERS, BATCH, SEQ = 64, 4, 2, 2, 16
LAYER = 1
"""The layer faults are planted in (the second, so that something precedes it)."""


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """A transformers architecture at test size, and where its parts live."""

    name: str
    kind: str
    """decoder, encoder, encoder-decoder or vision."""
    layers: str
    """The ModuleList of blocks (FQN)."""
    attention: str
    """The attention module inside a block (relative name)."""
    norm: str
    """A norm inside a block (relative name) that a fault re-implements."""
    rotary: str | None = None
    """The rotary embedding module (FQN), for RoPE families."""

    def build(self, vocab: int, attn: str) -> torch.nn.Module:
        import transformers as tf

        common = dict(attn_implementation=attn)
        if self.name in ("llama", "mistral", "qwen2", "gemma"):
            config_cls, model_cls = {
                "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
            }[self.name]
            config = config_cls(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                                head_dim=HIDDEN // HEADS, max_position_embeddings=64, **common)
            return model_cls(config)
        if self.name == "phi":
            return tf.PhiForCausalLM(tf.PhiConfig(
                vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attention_dropout=0.0, **common))
        if self.name == "gpt2":
            return tf.GPT2LMHeadModel(tf.GPT2Config(
                vocab_size=vocab, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common))
        if self.name == "bert":
            return tf.BertForMaskedLM(tf.BertConfig(
                vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=64, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, **common))
        if self.name == "t5":
            return tf.T5ForConditionalGeneration(tf.T5Config(
                vocab_size=vocab, d_model=HIDDEN, d_ff=2 * HIDDEN, num_layers=LAYERS, num_heads=HEADS,
                d_kv=HIDDEN // HEADS, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, **common))
        if self.name == "vit":
            return tf.ViTForImageClassification(tf.ViTConfig(
                hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, image_size=32, patch_size=8, num_labels=10,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common))
        raise ValueError(f"unknown family {self.name!r}")

    def batch(self, gen: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
        if self.kind == "vision":
            return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
                    "labels": torch.randint(0, 10, (BATCH,), generator=gen)}
        ids = torch.randint(1, vocab, (BATCH, SEQ), generator=gen)
        return {"input_ids": ids, "labels": ids}

    @property
    def vocabularies(self) -> tuple[int | None, ...]:
        return (None,) if self.kind == "vision" else (256, 1024, 32000)


_DECODER = dict(kind="decoder", layers="model.layers", attention="self_attn", norm="post_attention_layernorm",
                rotary="model.rotary_emb")
FAMILIES = {f.name: f for f in [
    Family("llama", **_DECODER),
    Family("mistral", **_DECODER),
    Family("qwen2", **_DECODER),
    Family("gemma", **_DECODER),
    Family("phi", kind="decoder", layers="model.layers", attention="self_attn", norm="input_layernorm",
           rotary="model.rotary_emb"),
    Family("gpt2", kind="decoder", layers="transformer.h", attention="attn", norm="ln_2"),
    Family("bert", kind="encoder", layers="bert.encoder.layer", attention="attention.self",
           norm="output.LayerNorm"),
    Family("t5", kind="encoder-decoder", layers="encoder.block", attention="layer.0.SelfAttention",
           norm="layer.1.layer_norm"),
    Family("vit", kind="vision", layers="vit.layers", attention="attention", norm="layernorm_after"),
]}


# --------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class Pair:
    """How run B's precision policy differs from run A's (fp32, 2 threads)."""

    name: str
    autocast: torch.dtype | None = None
    model_dtype: torch.dtype | None = None
    scaler: bool = False
    threads: int | None = None
    attn: str | None = None
    """Run B's attention implementation (None: the same as run A's)."""
    compiled: bool = False
    """Run B trains ``torch.compile(model)``, traced with ``compiled="keep"``."""
    accumulate: int = 1
    """Run B accumulates gradients over this many micro-batches of the batch."""

    @property
    def exact(self) -> bool:
        """Whether A and B compute alike bit for bit (faults of any size show)."""
        return self.name == "fp32"


PAIRS = {p.name: p for p in [
    Pair("fp32"),
    Pair("bf16-autocast", autocast=torch.bfloat16),
    Pair("fp16-autocast", autocast=torch.float16, scaler=True),
    Pair("bf16-model", model_dtype=torch.bfloat16),
    Pair("threads-1", threads=1),
]}
HEALTHY_PAIRS = ("bf16-autocast", "fp16-autocast", "bf16-model", "threads-1")


# --------------------------------------------------------------------------- faults


@dataclass
class Planted:
    """Where a fault was planted: the module an answer must name, and the step."""

    module: str
    step: int


def _norm_forward(norm: torch.nn.Module, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replaces ``norm.forward`` with ``compute``; the result is cast back to the input's dtype."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return compute(x).to(x.dtype)
    norm.forward = forward  # type: ignore[method-assign]


def _normalise(norm: torch.nn.Module, x: torch.Tensor, eps: float | None = None,
               reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``norm``'s computation written out (RMSNorm, Gemma's 1 + w, LayerNorm), optionally with
    another eps or the statistics reduced in ``reduce_dtype``."""
    weight = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) if eps is None else eps
    h = x.float()
    r = h if reduce_dtype is None else h.to(reduce_dtype)
    if isinstance(norm, torch.nn.LayerNorm):
        mean = r.mean(-1, keepdim=True).float()
        var = (r - mean.to(r.dtype)).pow(2).mean(-1, keepdim=True).float()
        h = (h - mean) * torch.rsqrt(var + eps)
    else:
        h = h * torch.rsqrt(r.pow(2).mean(-1, keepdim=True).float() + eps)
    if weight is not None:
        w = weight.float()
        h = h * (1.0 + w if type(norm).__name__.startswith("Gemma") else w)
    return h + bias.float() if bias is not None else h


def _attention_fault(model: torch.nn.Module, attention: torch.nn.Module, kind: str) -> None:
    """Layer ``attention`` runs its own attention function (the others are untouched):
    ``softmax_fp16``: softmax written as exp / sum in fp16, without subtracting the max;
    ``mask_shift``: the mask moved by one key position."""
    import copy

    import transformers

    def fault(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
              **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        scores = torch.matmul(query, key.transpose(2, 3)) * scale
        if attention_mask is None and getattr(module, "is_causal", False):
            n, m = scores.shape[-2:]
            attention_mask = torch.ones(n, m, dtype=torch.bool, device=scores.device).tril()
        if attention_mask is not None:
            mask = attention_mask[..., : key.shape[-2]]
            if kind == "mask_shift":
                mask = mask.roll(1, dims=-1)
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        if kind == "softmax_fp16":
            e = scores.half().exp()
            weights = (e / e.sum(-1, keepdim=True)).to(query.dtype)
        else:
            weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out = torch.matmul(weights, value).transpose(1, 2).contiguous()
        return out, weights

    name = f"probe_fault_{kind}"
    transformers.AttentionInterface.register(name, fault)
    config = copy.copy(attention.config)
    config._attn_implementation_internal = name  # only this module reads it
    attention.config = config


@dataclass(frozen=True)
class Fault:
    """A bug planted by construction. ``plant(model, family, steps)`` changes run B's model
    before training and returns where it is; ``before_step``/``loss`` act during training."""

    name: str
    exact_only: bool
    """Its effect is below the rounding of a lower-precision run: planted in fp32 pairs only."""
    families: tuple[str, ...] | None = None
    """The families it applies to (None: all)."""

    def applies(self, family: Family, pair: Pair) -> bool:
        if self.exact_only and not pair.exact:
            return False
        if self.name == "rotary_bf16" and family.rotary is None:
            return False
        if self.name == "eps_removed" and family.name in ("bert", "vit"):
            return False  # their layer norms' eps is 1e-12: removing it changes nothing
        if self.name in ("softmax_fp16", "mask_shift") and family.name == "t5":
            return False  # T5's attention does not use the attention interface the fault swaps
        return self.families is None or family.name in self.families

    def plant(self, model: torch.nn.Module, family: Family, steps: int) -> Planted:
        block = f"{family.layers}.{LAYER}"
        if self.name in ("norm_bf16", "eps_removed", "reduce_bf16"):
            path = f"{block}.{family.norm}"
            norm = model.get_submodule(path)
            compute = {
                "norm_bf16": lambda x: _normalise(norm, x.to(torch.bfloat16).float(),
                                                  reduce_dtype=torch.bfloat16).to(torch.bfloat16),
                "eps_removed": lambda x: _normalise(norm, x, eps=0.0),
                "reduce_bf16": lambda x: _normalise(norm, x, reduce_dtype=torch.bfloat16),
            }[self.name]
            _norm_forward(norm, compute)
            return Planted(path, 0)
        if self.name in ("softmax_fp16", "mask_shift"):
            path = f"{block}.{family.attention}"
            _attention_fault(model, model.get_submodule(path), self.name)
            return Planted(path, 0)
        if self.name == "rotary_bf16":
            assert family.rotary is not None
            rotary = model.get_submodule(family.rotary)
            rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16).float()
            return Planted(family.rotary, 0)
        if self.name == "weight_corrupt":
            return Planted(self._corrupted_linear(model, family), steps - 1)
        if self.name == "loss_scaled":
            return Planted("", 0)
        raise ValueError(self.name)

    @staticmethod
    def _corrupted_linear(model: torch.nn.Module, family: Family) -> str:
        attention = f"{family.layers}.{LAYER}.{family.attention}"
        names = [n for n, m in model.get_submodule(attention).named_modules()
                 if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
        return f"{attention}.{names[0]}"

    def before_step(self, model: torch.nn.Module, family: Family, step: int, planted: Planted) -> None:
        """Between steps: the weight element corrupted before the planted step."""
        if self.name == "weight_corrupt" and step == planted.step:
            weight = model.get_submodule(planted.module).weight
            with torch.no_grad():
                weight.view(-1)[7] += 0.5 * weight.abs().max()

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * 1.5 if self.name == "loss_scaled" else loss


FAULTS = {f.name: f for f in [
    Fault("norm_bf16", exact_only=False),
    Fault("reduce_bf16", exact_only=False),
    Fault("eps_removed", exact_only=True),
    Fault("weight_corrupt", exact_only=False),
    Fault("softmax_fp16", exact_only=False),
    Fault("mask_shift", exact_only=False),
    Fault("rotary_bf16", exact_only=False),
    Fault("loss_scaled", exact_only=False),
]}


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    family: str
    attn: str
    vocab: int | None
    steps: int
    optimizer: str
    modes: tuple[str, ...]
    pair: str
    fault: str | None = None

    @property
    def label(self) -> str:
        vocab = "-" if self.vocab is None else str(self.vocab)
        return (f"{self.family}/{self.attn}/v{vocab}/{self.steps}st/{self.optimizer}/{'+'.join(self.modes)}/"
                f"{self.pair}/{self.fault or 'healthy'}")


@dataclass
class Outcome:
    case: Case
    found: bool | None
    """Healthy: whether a divergence was reported (a false alarm). Fault: whether the answer
    named the planted module and step."""
    at_op: bool | None = None
    conclusion: str = ""
    answer: str = ""
    expected: str = ""
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        if self.error is not None:
            return False
        return not self.found if self.case.fault is None else bool(self.found)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def record(case: Case, out: Path, side: str) -> Planted | None:
    """Trains ``case``'s model for its steps under the probe; ``side`` "a" is the fp32 reference,
    "b" carries the pair's policy and the fault. Returns where the fault was planted."""
    import probe

    family = FAMILIES[case.family]
    pair = PAIRS[case.pair] if side == "b" else PAIRS["fp32"]
    fault = FAULTS[case.fault] if side == "b" and case.fault else None
    vocab = case.vocab or 256
    torch.manual_seed(0)
    model = family.build(vocab, case.attn)
    if pair.model_dtype is not None:
        model = model.to(pair.model_dtype)
    planted = fault.plant(model, family, case.steps) if fault is not None else None
    params = list(model.parameters())
    opt: torch.optim.Optimizer = (torch.optim.AdamW(params, lr=1e-3) if case.optimizer == "adamw"
                                  else torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    # Both runs scale their losses alike when B uses a GradScaler (A's in fp32 never overflows).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if PAIRS[case.pair].scaler else None
    gen = torch.Generator().manual_seed(1)
    # With sketches where the stats mode records, as docs/compare.md asks of a compare: without them
    # a difference of random signs is measured by statistics that understate it, and whether a
    # healthy pair crosses its bound depends on the CPU's kernels (T5's fp16-autocast layer norm
    # does on an Intel VM, not on an AMD one).
    options = {"sketch": True} if "stats" in case.modes else {}
    with _threads(pair.threads), \
            probe.mode(list(case.modes), out=str(out), model=model, **options) as session:
        for step in range(case.steps):
            batch = family.batch(gen, vocab)
            if pair.model_dtype is not None:
                batch = {k: v.to(pair.model_dtype) if v.is_floating_point() else v for k, v in batch.items()}
            if fault is not None and planted is not None:
                with session.paused():  # silent corruption: nothing traces it
                    fault.before_step(model, family, step, planted)
            autocast = pair.autocast or torch.bfloat16
            with torch.autocast("cpu", dtype=autocast, enabled=pair.autocast is not None):
                loss = model(**batch).loss
            loss = fault.loss(loss) if fault is not None else loss
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            session.step()
    return planted


def inside(module: str, planted: str) -> bool:
    """Whether ``module`` is the ``planted`` module or one inside it."""
    return module == planted or (planted != "" and module.startswith(planted + "."))


def run_case(case: Case, root: Path, references: dict[Case, Path]) -> Outcome:
    """Records run B (and run A, once per reference configuration) and judges the answer."""
    import probe

    start = time.perf_counter()
    key = replace(case, pair="fp32", fault=None)
    try:
        if key not in references:
            references[key] = root / f"a{len(references)}"
            record(key, references[key], "a")
        out_b = root / f"b-{abs(hash(case))}"
        planted = record(case, out_b, "b")
        report = probe.compare(references[key], out_b)
    except Exception as e:  # a crash is an outcome of the benchmark, reported per case
        error = f"{type(e).__name__}: {e}"[:300]
        return Outcome(case, None, error=error, seconds=time.perf_counter() - start)
    a = judge(report, planted)
    return Outcome(case, a.found, a.at_op, a.conclusion, a.answer, a.expected, time.perf_counter() - start)


@dataclass(frozen=True)
class Answer:
    """What a comparison answered, judged against what was planted."""

    found: bool
    """Healthy: whether a divergence was reported (a false alarm). Fault: whether the answer
    named the planted module and step."""
    at_op: bool | None
    conclusion: str
    answer: str
    """The first divergence in a few words ("none" without one)."""
    expected: str


def judge(report: Any, planted: Planted | None) -> Answer:
    """Scores ``probe.compare``'s ``report``: for a healthy pair (``planted`` None) any divergence,
    or a conclusion that does not start with "no divergence", is a false alarm; for a fault the
    first divergence must be at the planted step, in the planted module or inside it, and the
    conclusion must name the module."""
    d = report.divergence
    answer = "none" if d is None else \
        f"step {d.step} {d.op.module or '<outside modules>'} {d.op.name} ({d.rule})"
    conclusion = report.conclusion
    if planted is None:
        found = d is not None or not conclusion.startswith("no divergence")  # the line a person reads
        return Answer(found, None, conclusion, answer, "no divergence")
    where = planted.module or "<outside modules>"
    expected = f"step {planted.step} {where}"
    found = d is not None and d.step == planted.step and inside(d.op.module, planted.module) \
        and where in conclusion
    # Planted before the first step, a weight is a difference the runs started with: the
    # start check names the parameter.
    found = found or (planted.step == 0 and conclusion.startswith("the runs did not start alike")
                      and planted.module in conclusion)
    return Answer(found, found, conclusion, answer, expected)


def matrix(quick: bool, families: list[str]) -> list[Case]:
    """The generated cases. Full: every family x attention x vocabulary x healthy pair, and each
    fault that applies under each pair it applies to with the vocabularies in rotation, over
    steps {1, 3} x optimizers x modes in a rotation (so each value of each dimension meets
    every family). Quick: one vocabulary and attention per family in rotation, 2 steps, the
    stats mode, the faults in rotation."""
    cases: list[Case] = []
    rotation = itertools.count()
    for name in families:
        family = FAMILIES[name]
        attns = ("sdpa", "eager")
        vocabs = family.vocabularies
        for attn, vocab in itertools.product(attns, vocabs):
            i = next(rotation)
            if quick and (i % len(vocabs) != (0 if attn == "sdpa" else 1) % len(vocabs)):
                continue
            steps = 2 if quick else (1, 3)[i % 2]
            optimizer = ("adamw", "sgd")[i % 2 if not quick else 0]
            modes = ("stats",) if quick else (("stats",), ("stats", "dump"))[(i // 2) % 2]
            for pair in HEALTHY_PAIRS:
                if quick and pair == "threads-1" and i % 2:
                    continue
                cases.append(Case(name, attn, vocab, steps, optimizer, modes, pair))
            fault_names = [f for f, fault in FAULTS.items() if fault.applies(family, PAIRS["fp32"])]
            for j, fault_name in enumerate(fault_names):
                fault = FAULTS[fault_name]
                for pair_name in ("fp32", "bf16-autocast"):
                    if not fault.applies(family, PAIRS[pair_name]):
                        continue
                    # Each fault meets every vocabulary over the attentions and faults (full),
                    # a third of the faults per model (quick).
                    if (quick and (j + i) % 3) or (not quick and (j + i) % len(vocabs)):
                        continue
                    cases.append(Case(name, attn, vocab, steps, optimizer, modes, pair_name, fault_name))
    return cases


def summarise(outcomes: list[Outcome]) -> dict[str, Any]:
    healthy = [o for o in outcomes if o.case.fault is None]
    faults = [o for o in outcomes if o.case.fault is not None]
    false_alarms = [o for o in healthy if not o.ok]
    found = [o for o in faults if o.ok]
    return {
        "healthy": len(healthy), "false_divergences": len(false_alarms),
        "faults": len(faults), "found": len(found),
        "found_share": len(found) / len(faults) if faults else math.nan,
        "errors": sum(o.error is not None for o in outcomes),
    }


def _table(title: str, rows: list[list[str]], header: list[str]) -> Table:
    table = Table(title=title)
    for h in header:
        table.add_column(h)
    for r in rows:
        table.add_row(*r)
    return table


def report(outcomes: list[Outcome], console: Console | None, markdown: Path | None,
           seconds: float, planned: int | None = None) -> dict[str, Any]:
    """Prints the tables (``console``) and writes them (``markdown``); ``planned``: the cases of
    a run still going (the file says how many are done)."""
    totals = summarise(outcomes)
    by: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        by.setdefault((o.case.family, o.case.fault or "healthy"), []).append(o)
    header = ["family", "cases", "healthy: false divergences", "faults found at module and step"]
    rows = []
    for family in sorted({o.case.family for o in outcomes}):
        mine = [o for o in outcomes if o.case.family == family]
        s = summarise(mine)
        rows.append([family, str(len(mine)), f"{s['false_divergences']} / {s['healthy']}",
                     f"{s['found']} / {s['faults']}"])
    rows.append(["all", str(len(outcomes)), f"{totals['false_divergences']} / {totals['healthy']}",
                 f"{totals['found']} / {totals['faults']} ({100 * totals['found_share']:.0f}%)"])
    misses = [o for o in outcomes if not o.ok]
    miss_rows = [[o.case.label, o.expected, o.error or o.answer] for o in misses]
    if console is not None:
        console.print(_table("Diagnosis benchmark", rows, header))
        if misses:
            console.print(_table("Wrong answers", miss_rows, ["case", "expected", "answer"]))
    if markdown is not None:
        lines = ["# Diagnosis benchmark", "",
                 f"`python -m benchmarks.diagnosis{' --quick' if (planned or len(outcomes)) < 150 else ''}`: "
                 f"{len(outcomes)} cases in {seconds:.0f} s on {_machine()}"
                 + (f" (in progress: {len(outcomes)} of {planned})" if planned else "") + ".", "",
                 "Targets: 0 false divergences over the healthy pairs; >= 95% of planted faults "
                 "named at the planted module and step.", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        if misses:
            lines += ["", "## Wrong answers", "", "| case | expected | answer |", "|---|---|---|"]
            lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in miss_rows]
        lines += ["", "## Every case", "", "| case | answer | seconds |", "|---|---|---|"]
        lines += [f"| {o.case.label} | {(o.error or o.answer).replace('|', '/')} | {o.seconds:.1f} |"
                  for o in outcomes]
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text("\n".join(lines) + "\n")
    return totals


def _machine() -> str:
    import platform

    return f"{platform.machine()} CPU x{torch.get_num_threads()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the covering subset CI runs (a few minutes)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families")
    parser.add_argument("--faults", default=None, help="comma-separated faults (default: all)")
    parser.add_argument("--healthy-only", action="store_true")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table there too")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    warnings.filterwarnings("ignore")
    cases = matrix(args.quick, families)
    if args.faults is not None:
        keep = set(args.faults.split(","))
        cases = [c for c in cases if c.fault is None or c.fault in keep]
    if args.healthy_only:
        cases = [c for c in cases if c.fault is None]
    console = Console()
    outcomes: list[Outcome] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        references: dict[Case, Path] = {}
        from rich.progress import Progress

        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("cases", total=len(cases))
            for case in cases:
                outcome = run_case(case, Path(tmp), references)
                outcomes.append(outcome)
                if not outcome.ok:
                    console.print(f"[red]miss[/red] {case.label}: expected {outcome.expected}, "
                                  f"got {outcome.error or outcome.answer}")
                progress.advance(task)
                if args.markdown is not None and len(outcomes) % 25 == 0:  # a long run leaves its part
                    report(outcomes, None, args.markdown, time.perf_counter() - start, len(cases))
    totals = report(outcomes, console, args.markdown, time.perf_counter() - start)
    met = totals["false_divergences"] == 0 and (totals["faults"] == 0 or totals["found_share"] >= 0.95)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
