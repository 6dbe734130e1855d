"""The zoo (``benchmarks.zoo``): its architectures come from transformers' Auto mappings, each
builds from its shrunk default config or is kept with the reason it does not, and a case runs end
to end (two trainings under the stats mode, compared and scored). The whole zoo is the benchmark;
this checks the instrument, not the compare rules it measures."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is an optional test dependency")

from hf_models import zoo_case

from benchmarks.zoo import PAIRS, Case, Reference, applies, run_case
from benchmarks.zoo_architectures import (
    LAYERS,
    Architecture,
    Built,
    NotBuilt,
    architectures,
    build,
    shrink_config,
    shrunk,
)
from benchmarks.zoo_faults import KINDS, plant


def test_every_causal_lm_architecture_is_listed_and_shrinks():
    import transformers

    archs = architectures("causal-lm")
    assert len(archs) > 100
    assert {"llama", "gpt2", "qwen3", "mistral"} <= {a.name for a in archs}
    shrinkable = 0
    for arch in archs:
        try:
            values = shrink_config(transformers.CONFIG_MAPPING[arch.model_type]().to_dict())
            shrunk(arch)
        except Exception as e:  # a default config that does not build, or refuses its shrunk values
            reason = build(arch)
            assert isinstance(reason, NotBuilt) and reason.reason.startswith(type(e).__name__), arch
            continue
        shrinkable += 1
        depths = [values[k] for k in ("num_hidden_layers", "n_layer", "num_layers")
                  if isinstance(values.get(k), int)]
        widths = [values[k] for k in ("hidden_size", "d_model", "n_embd") if isinstance(values.get(k), int)]
        assert all(n <= LAYERS for n in depths) and all(w <= 64 for w in widths), (arch, depths, widths)
    assert shrinkable > 100


def test_an_architecture_that_does_not_build_is_kept_with_its_reason():
    missing = Architecture("causal-lm", "llama", "NoSuchModelForCausalLM")
    result = build(missing)
    assert isinstance(result, NotBuilt)
    assert result.reason.startswith("AttributeError: ") and "NoSuchModelForCausalLM" in result.reason


def test_shrinking_keeps_one_layer_of_each_kind_of_a_hybrid():
    values = {"num_hidden_layers": 8, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 4,
              "vocab_size": 32000, "pad_token_id": 31999, "hidden_dropout": 0.1, "mask_time_prob": 0.05,
              "text_config": {"hidden_size": 2048, "num_hidden_layers": 30}}
    small = shrink_config(values)
    assert small["num_hidden_layers"] == LAYERS
    assert small["layer_types"] == ["linear_attention", "full_attention"]
    assert small["hidden_size"] == 64 and small["num_attention_heads"] == 4
    assert small["num_key_value_heads"] == 2
    assert small["pad_token_id"] < small["vocab_size"] == 512
    assert small["hidden_dropout"] == 0.0 and small["mask_time_prob"] == 0.0  # random in training: off
    assert small["text_config"]["num_hidden_layers"] == LAYERS


@pytest.fixture(scope="module")
def llama() -> Built:
    arch = next(a for a in architectures("causal-lm") if a.name == "llama")
    built = build(arch)
    assert isinstance(built, Built), built
    return built

def test_a_hierarchical_vision_config_shrinks_to_stages_that_divide_its_widths():
    """Swin's per-stage lists are as long as its stage count (num_layers): kept to LAYERS
    stages, they still shrink as stages (heads dividing the width), its window fits the
    shrunk image, and a group norm's groups divide the shrunk channels (BiT)."""
    swin = shrink_config({"embed_dim": 96, "depths": [2, 2, 6, 2], "num_heads": [3, 6, 12, 24],
                          "num_layers": 4, "window_size": 7, "image_size": 224, "patch_size": 4})
    assert swin["num_layers"] == len(swin["depths"]) == len(swin["num_heads"]) == LAYERS
    assert swin["depths"] == [1] * LAYERS
    assert all(swin["embed_dim"] % h == 0 for h in swin["num_heads"]), swin
    assert swin["window_size"] <= swin["image_size"] // swin["patch_size"] // 2 ** (LAYERS - 1)
    bit = shrink_config({"hidden_sizes": [256, 512, 1024, 2048], "num_groups": 32})
    assert all(width % bit["num_groups"] == 0 for width in bit["hidden_sizes"]), bit



def test_a_healthy_case_and_a_planted_fault_run_end_to_end(llama, tmp_path: Path):
    references: dict[Reference, Path] = {}
    healthy = run_case(Case(llama.arch, "fp32"), llama, tmp_path, references)
    assert healthy.error is None and healthy.ok, healthy
    assert healthy.answer == "none" and healthy.conclusion.startswith("no divergence")
    fault = run_case(Case(llama.arch, "fp32", "scale-output"), llama, tmp_path, references)
    assert fault.error is None, fault.error
    assert len(references) == 1  # the fault's run B is compared with the same run A
    # The planted module and step, as the case chose them, and the compare's answer at them.
    step, module = fault.site.split()[1:3]
    assert fault.expected == f"step {step} {module}"
    assert fault.ok, (fault.site, fault.answer)
    assert fault.module == module or fault.module.startswith(module + ".")


def test_a_slice_killed_half_way_resumes_from_its_records(tmp_path: Path):
    from benchmarks.zoo import load_results, main

    table = tmp_path / "zoo-cnn.md"
    slice_ = ["--task", "cnn", "--pairs", "fp32", "--faults", "none", "--markdown", str(table)]
    assert main(slice_) == 0
    first = load_results(table.with_suffix(".jsonl"))
    assert [r.arch.name for r in first] == ["cnn-batchnorm"]
    assert [(o.case.pair, o.ok, o.answer) for o in first[0].outcomes] == [("fp32", True, "none")]
    # Resumed, the architecture recorded is kept as it was (its seconds too), not run again.
    assert main([*slice_, "--resume"]) == 0
    assert load_results(table.with_suffix(".jsonl")) == first
    seconds = first[0].outcomes[0].seconds
    assert f"| cnn/cnn-batchnorm/fp32/healthy |  | none | {seconds:.1f} |" in table.read_text()


def test_a_cast_the_run_b_policy_makes_itself_is_not_applicable(llama, tmp_path: Path):
    # bf16 autocast runs matmuls in bf16: a bf16 cast before them is autocast's own computation,
    # not a miss to count. Under fp16 autocast the cast (to bf16) is still one autocast never makes.
    skipped = run_case(Case(llama.arch, "bf16-autocast", "cast-matmul"), llama, tmp_path, {})
    assert skipped.skipped is not None and "autocast" in skipped.skipped, skipped
    assert applies(Case(llama.arch, "fp16-autocast", "cast-matmul"), llama) is None
    assert applies(Case(llama.arch, "bf16-autocast", "cast-softmax"), llama) is None
    # A bf16 model's matmuls are bf16: the cast only undoes a widening its own code makes (a
    # router in fp32), which computes as a bf16 model does, within run B's precision of run A.
    why = applies(Case(llama.arch, "bf16-model", "cast-matmul"), llama)
    assert why is not None and "bf16 itself" in why, why


def test_a_model_that_fails_under_run_b_policy_without_the_probe_is_not_applicable(tmp_path: Path):
    # DeBERTa fills its bf16 attention scores with float32's minimum under autocast: the model's
    # own error, with or without the probe, so the case does not apply (it is no crash of it).
    outcome = zoo_case("masked-lm", "deberta", "bf16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is not None, outcome
    assert "without the probe" in outcome.skipped and "BFloat16" in outcome.skipped


def test_an_overflow_is_named_by_first_nonfinite_at_its_module_and_step(llama, tmp_path: Path):
    # The overflow kind is scored twice: compare's answer, and run B's first_nonfinite(), which must
    # name the planted module and step (a mask's -inf named instead is a miss).
    outcome = run_case(Case(llama.arch, "fp16-autocast", "overflow"), llama, tmp_path, {})
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok and "first_nonfinite" not in outcome.answer, (outcome.site, outcome.answer)


def test_a_model_whose_gradients_are_not_finite_under_run_b_policy_is_not_applicable(tmp_path: Path):
    # LongT5 adds its -1e10 position-bias mask to fp16 scores: -inf, whole rows of it, a NaN
    # softmax and NaN gradients on every step. The probe names that overflow rightly; the pair is
    # no healthy pair (before: a false divergence).
    outcome = zoo_case("seq2seq-lm", "longt5", "fp16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is not None, outcome
    assert "gradient of" in outcome.skipped and "not finite" in outcome.skipped
    # A fault planted in such a pair is not applicable either: the model's own overflow comes first,
    # in the encoder, before the decoder's norm the fault casts (before: a miss).
    outcome = zoo_case("seq2seq-lm", "longt5", "fp16-autocast", tmp_path / "fault", "cast-norm")
    assert outcome.error is None and outcome.skipped is not None, outcome
    assert "without the probe" in outcome.skipped


def test_a_gradient_fp16_flushes_to_zero_is_rounding_at_a_black_box_boundary(tmp_path: Path):
    # MobileBERT's first query weight gradient is ~1e-10 (x256 scaled: 3e-8, below fp16's smallest
    # subnormal): the fp16 matmul flushes it to 0, and the scaler's unscale reads it through ops of
    # run B only. Before: 'unmatched producer' (1.0 apart against a relative bound of 0.84); the
    # subnormal spacing over the value's rms is that rounding.
    outcome = zoo_case("masked-lm", "mobilebert", "fp16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_an_embedding_that_repeats_the_rows_it_selects_reads_what_the_step_before_wrote(tmp_path: Path):
    # CPM-Ant's segment embedding: 32 rows, 3 selected by all 96 tokens. Step 0's AdamW moved the
    # selected rows' elements by +-lr, some the other way under bf16 (gradients near zero), while
    # the table's statistics barely moved (their extremes and most of its norm are the rows not
    # selected). The selection's gain (table norm over output norm) is below 1 because the output
    # repeats each row 32 times, so the state's stand-in was skipped: 'propagation' at step 1.
    outcome = zoo_case("causal-lm", "cpmant", "bf16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_a_value_each_run_copies_its_own_way_and_a_sum_of_a_buffer_view_are_rounding(tmp_path: Path):
    # Longformer, fp32 against bf16 autocast. Its LM head's dense layer reads a slice of the
    # encoder's output: F.linear in float32 `clone`s it and `_unsafe_view`s it for an `mm`; under
    # autocast the cast makes it contiguous and a `view` feeds an `addmm`. Each run's producers of
    # the weight gradient's input were its own ops, so the pair was refused and the gradient judged
    # as made by ops of run B only ('unmatched producer' at lm_head.dense, step 0). Past that, the
    # key bias's gradient (zero in exact arithmetic: each run's value is its rounding) sums a view
    # of a buffer `copy_` filled, which has no statistics of its own: its cancellation was taken
    # as 1 ('propagation', 1.0 apart against 0.28).
    outcome = zoo_case("masked-lm", "longformer", "bf16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


@pytest.mark.parametrize("name", ["glm4", "qwen3_5_moe_text"])
def test_a_cancelling_sum_of_values_whose_elements_differ_at_random_signs_is_rounding(name, tmp_path: Path):
    # Eager against SDPA attention, fp32: after step 0's AdamW the runs' elements differ at random
    # signs, which leave their statistics nearly as they were. GLM-4: the post-attention norm's
    # backward sums a row of 64 products whose terms cancel; its max moved 2.1e-5, beyond 32 x the
    # inputs' 2.7e-7 (statistics) + rounding. Before sketches: 'propagation' at step 1. The
    # sketches measure the elements' difference itself. Qwen3.5-MoE's linear attention sums 32
    # terms into 4 whose errors are not of random sign: its bound is Cauchy-Schwarz's, sqrt(32)
    # times the sum's cancellation.
    outcome = zoo_case("causal-lm", name, "eager-attention", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_a_mask_shift_where_no_mask_is_shifted_is_not_applicable(tmp_path: Path):
    # BERT-generation's encoder gets no mask (its all-ones mask is dropped): the fault's attention
    # function, swapped in, only re-implements attention, whose rounding alone changes the loss.
    # Measured against that function unshifted, nothing changes: no fault to find (before: a miss).
    outcome = zoo_case("causal-lm", "bert-generation", "bf16-model", tmp_path, "mask-shift")
    assert outcome.error is None and outcome.skipped is not None, outcome
    assert "mask-shift" in outcome.skipped


_SHARED_ACT = torch.nn.GELU()
"""One activation instance for every model, as XLM's module-level ``gelu``."""


class _SharedActivation(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.act0, self.act1 = _SHARED_ACT, _SHARED_ACT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act1(self.second(self.act0(self.first(x))))


class _NoNorm(torch.nn.Module):
    """MobileBERT's NoNorm: an elementwise affine map, its fp32 weight promoting a bf16 input."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.rand(8) + 0.5), torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class _NormAfterLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.norm = torch.nn.Linear(8, 8), _NoNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.dense(x))


def test_a_cast_of_a_norm_input_already_in_bf16_plants_nothing():
    # Under bf16 autocast a linear's output is bf16 already: the planted cast of the norm's input
    # did nothing, and casting the norm's fp32 result back to bf16 is what every transformers norm
    # does under autocast (``.to(input_dtype)``): a 'fault' no bound can tell from the idiom
    # (MobileBERT's NoNorm, a miss of the masked-LM slice).
    model = _NormAfterLinear()
    fault = plant(KINDS["cast-norm"], model, "norm", random.Random(0), PAIRS["bf16-autocast"], steps=2)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inner = model.dense(x)
        healthy = model.norm(inner)
        fault.active = True
        planted = model.norm(inner)
    assert inner.dtype == torch.bfloat16 and healthy.dtype == planted.dtype == torch.float32
    assert torch.equal(planted, healthy)
    wide = torch.randn(4, 8)  # an fp32 input is cast: the fault changes the result
    fault.active = False
    healthy = model.norm(wide)
    fault.active = True
    assert not torch.equal(model.norm(wide), healthy)


def test_a_fault_planted_in_a_shared_module_runs_at_its_site_only():
    # XLM's feed-forward layers all call one module-level activation: a scale planted in it ran at
    # every layer and in every model the process built after (the next case's healthy run B).
    model = _SharedActivation()
    fault = plant(KINDS["scale-output"], model, "act0", random.Random(0), PAIRS["fp32"], steps=2)
    fault.active = True
    x = torch.randn(4, 8)
    assert model.act0 is not _SHARED_ACT and model.act1 is _SHARED_ACT and "forward" not in vars(_SHARED_ACT)
    assert torch.equal(model.act1(x), torch.nn.functional.gelu(x))
    assert not torch.equal(model.act0(x), torch.nn.functional.gelu(x))
    assert torch.equal(_SharedActivation().act0(x), torch.nn.functional.gelu(x))  # a model built after


@pytest.mark.parametrize("name", ["openai-gpt", "cpmant"])
def test_a_compiled_graph_decomposing_otherwise_is_never_paired_by_the_nth_op_of_a_name(name, tmp_path: Path):
    # Eager against torch.compile (compiled="keep"): the graph's own decomposition (softmax as
    # amax, sub, exp, sum, div; _unsafe_view as view) shifts the n-th `view` of a module call onto
    # another value of the eager run. GPT's attention: the eager `view` of the softmax's output was
    # paired with the graph's `view` of q, whose input the eager softmax chain was taken for an
    # insertion on ('unmatched producer', 0.99 relative). CPM-Ant's position bias: its two
    # `view`s read positions each run computed with ops of its own, outside the module call. Both
    # runs are the same computation: no divergence.
    outcome = zoo_case("causal-lm", name, "compiled", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_a_compiled_model_with_graph_breaks_attributes_its_eager_gaps_to_their_modules(tmp_path: Path):
    # JetMoe under torch.compile breaks its graphs inside the router, the rotary embedding and the
    # attention: dynamo compiled the probe's module hooks run between graphs, to no-ops, so only
    # the OptimizedModule wrapper's fired, and every eager op between graphs was attributed to it
    # (its embedding did not pair with the eager run's model.embed_tokens one: 'unmatched
    # producer', step 0); one decoder-layer graph serving both layers put layer 1's re-run ops in
    # layer 0; and autograd's zeros for a gradient the compiled backward did not produce was
    # paired by name with SDPA's empty one ('shape'). Both runs are the same computation: no
    # divergence.
    outcome = zoo_case("causal-lm", "jetmoe", "compiled", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_a_table_the_model_casts_and_keeps_in_forward_is_state_the_next_step_reads(tmp_path: Path):
    # wav2vec2-conformer's relative positions: step 0 extends its fp32 table and, under autocast,
    # keeps it cast to bf16; step 1 reads the bf16 table from outside the step. Run B's step 0
    # made that value (a forward op's result), so it did not change between the steps.
    outcome = zoo_case("audio-classification", "wav2vec2-conformer", "bf16-autocast", tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


@pytest.mark.parametrize(("task", "name", "pair"), [
    # The loss's cast of the logits, outside every module under autocast, is a `_to_copy` run A lacks:
    # the GradScaler's later `_to_copy`s outside modules were paired by their shifted ids (the
    # scale's float64 copy with the inverse scale's float32 one), 'unmatched producer' at step 0.
    ("cnn", "cnn-batchnorm", "fp16-autocast"),
    # ConvNeXt's layer scale (1e-6) makes gradients of ~4e-6, cast into fp16's subnormal range by a
    # cast of run B only: an absolute rounding the relative model of casts lacked.
    ("image-classification", "convnext", "fp16-autocast"),
    # An `mm` decomposition (fp32, strided input) against `addmm` (autocast): the `t` of the weight,
    # read from outside the step, was paired by id with the `t` of run B's weight gradient.
    ("image-classification", "perceiver", "fp16-autocast"),
    # BiT standardises its conv weights (a batch norm of the weight): step 0's AdamW moved a few of
    # their elements by 2 lr the other way under bf16 (gradients near zero), which the weight's
    # statistics do not show (3.9e-5); its sketches measure the elements (1.3e-3).
    ("image-classification", "bit", "bf16-autocast"),
    # SegFormer's reduced keys: one key per head at stage 3, so attention's q and k gradients are 0
    # in exact arithmetic and each run's (1e-11, 1e-12) is rounding alone.
    ("image-classification", "segformer", "bf16-autocast"),
    # MobileNetV2's scaled gradients overflow fp16 at scale 256: run B's scaler skips steps run A's
    # takes. Loss scaling at work: compared up to the overflow, then not compared, and said.
    ("image-classification", "mobilenet_v2", "fp16-autocast"),
])
def test_the_image_populations_healthy_classes(task: str, name: str, pair: str, tmp_path: Path):
    outcome = zoo_case(task, name, pair, tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


@pytest.mark.parametrize(("name", "pair"), [
    # Funnel's predictions are certain after a step (log-probabilities 0 and -88.7): log-softmax's
    # backward, g - exp(y) sum(g), cancels to rounding (1e-7 against a gradient of 1e-3), and one
    # thread against two moved its max by 7.6e-6 relative: 'propagation' at the loss's backward,
    # with log-softmax's backward counted as no cancellation at all.
    ("funnel", "threads-1"),
    # Gradient accumulation: autograd reduces Longformer's key bias gradient to [1, 1, 64] from a
    # batch of 2 and to [1, 64] from a micro-batch of 1, and Funnel's attention permutes a [1, ...]
    # value another way: the same elements in the same order, called a 'shape' divergence.
    ("longformer", "accumulate-2"),
    ("funnel", "accumulate-2"),
    # NeoBERT's embedding norm's backward sums rows whose terms cancel (x509); its input is a value
    # the fold joins from the micro-batches', whose sketches do not join, so only its statistics
    # measured it (5e-6 apart, where after a step of AdamW its elements are 1e-3 apart):
    # 'propagation'. Now not compared, with the reason.
    ("neomme", "accumulate-2"),
])
def test_the_masked_lm_populations_other_pairs(name: str, pair: str, tmp_path: Path):
    outcome = zoo_case("masked-lm", name, pair, tmp_path)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


def test_the_audio_population_accumulate_pair():
    # AST's CLS and distillation tokens are expanded over the batch: with micro-batches of one,
    # AccumulateGrad keeps cat's gradient slice itself as .grad, which the second adds into; the
    # slice was compared as that .grad, a 'shape' divergence against the batch's [2, 1, 64].
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        outcome = zoo_case("audio-classification", "audio-spectrogram-transformer", "accumulate-2", root)
    assert outcome.error is None and outcome.skipped is None, outcome
    assert outcome.ok, (outcome.answer, outcome.conclusion)


@pytest.mark.parametrize(("name", "batchnorm"), [("wav2vec2-conformer", True), ("hubert", False)])
def test_batchnorm_is_read_from_the_modules_not_the_config(name: str, batchnorm: bool):
    # wav2vec2-conformer's convolution module has a BatchNorm no config key names (its accumulate
    # pair was run, and called divergent: micro-batches normalise over themselves); HuBERT's config
    # has a key 'conv_pos_batch_norm' (False), and its pair was skipped.
    arch = next(a for a in architectures("audio-classification") if a.name == name)
    built = build(arch)
    assert isinstance(built, Built), built
    state = torch.random.get_rng_state()
    assert built.has_batchnorm is batchnorm
    assert torch.equal(torch.random.get_rng_state(), state)  # building it drew nothing of the caller's
