"""The recipe lab: reference quantizers on hand-computed values (and torchao's, bit for bit, where
it is installed), what-if statistics ranking a planted outlier channel first, plans written and
read back, and the fake_quant mode (an empty plan leaves training bit-identical)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import probe
from probe.cli import main
from probe.modes.recipes import RECIPES, Plan, Recipe
from probe.modes.recipes.quantize import e2m1_codes, e2m1_values, e8m0_exponent, fake_quantize, what_if
from probe.modes.recipes.ranking import plan, rank_matmuls
from tests.hf_models import assert_trained_alike, tiny_llama, train_steps

OUTLIER_LAYER, OUTLIER_CHANNEL = 1, 5


def _stats(x: torch.Tensor, recipe: str) -> dict[str, float]:
    names = ("nonzero", "underflow", "saturated", "error_sq", "signal_sq", "block_range_log2")
    return dict(zip(names, what_if(x, RECIPES[recipe]).tolist(), strict=True))


def test_e2m1_rounds_to_nearest_ties_to_even():
    # OCP MX v1.0 table 5: 0, 0.5, 1, 1.5, 2, 3, 4, 6; a midpoint goes to the even code.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, -0.75, -6.0])
    assert e2m1_values(e2m1_codes(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, -1.0, -6.0]


def test_mxfp8_block_shares_floor_log2_amax_minus_emax():
    # amax 1000: floor(log2 1000) = 9, e4m3's emax 8, so the block's scale is 2^1.
    block = torch.zeros(32)
    block[:4] = torch.tensor([1000.0, 3.0, 2.0 ** -10, 0.3])
    assert e8m0_exponent(block.abs().amax().reshape(1), 448.0).item() == 1
    out = fake_quantize(block, RECIPES["mxfp8"])
    # 1000/2 = 500 saturates to 448; 3/2 exact; 2^-11 is below half e4m3's smallest subnormal (2^-9);
    # 0.3/2 = 0.15 lies in [0.125, 0.25) where e4m3 steps by 2^-6: 0.15625.
    assert out[:4].tolist() == [896.0, 3.0, 0.0, 0.3125]
    stats = _stats(block, "mxfp8")
    assert (stats["nonzero"], stats["underflow"], stats["saturated"]) == (4, 1, 1)
    assert stats["block_range_log2"] == pytest.approx(math.log2(1000 / 2 ** -10))


def test_fp8_per_tensor_current_scaling():
    # amax 4 -> scale 448/4 = 112; 0.3 * 112 = 33.6 lies in [32, 64) where e4m3 steps by 4: 32.
    x = torch.tensor([4.0, 0.3, -1.0])
    assert fake_quantize(x, RECIPES["fp8-e4m3"]).tolist() == pytest.approx([4.0, 32 / 112, -1.0])
    stats = _stats(x, "fp8-e4m3")
    assert stats["saturated"] == 0 and stats["underflow"] == 0
    assert stats["error_sq"] == pytest.approx((0.3 - 32 / 112) ** 2)


def test_nvfp4_two_level_scales():
    # amax 6: per-tensor scale 6 / (448 * 6); the block scale (6/6) / that = 448, exact in e4m3.
    # The per-tensor scale is not exact in fp32 (so no value here sits on a rounding tie).
    x = torch.zeros(16)
    x[:4] = torch.tensor([6.0, 2.6, 0.2, -1.8])
    eps = torch.finfo(torch.float32).eps
    quantized = fake_quantize(x, RECIPES["nvfp4"])[:4].tolist()
    assert quantized == pytest.approx([6.0, 3.0, 0.0, -2.0], rel=2 * eps)
    assert _stats(x, "nvfp4")["underflow"] == 1


def test_recipe_errors_name_the_value():
    with pytest.raises(probe.ProbeError, match="'fp9'"):
        probe.mode("whatif", recipes=["fp9"])
    with pytest.raises(probe.ProbeError, match="element format"):
        Recipe("mine", "e3m3")
    with pytest.raises(probe.ProbeError, match="'plan' is required"):
        probe.mode("fake_quant")


_TORCHAO = importlib.util.find_spec("torchao") is not None


@pytest.mark.skipif(not _TORCHAO, reason="torchao is not installed (pip install probe[recipes])")
def test_mx_and_nvfp4_match_torchao_bit_for_bit():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    gen = torch.Generator().manual_seed(0)
    # Magnitudes over 2^-20 .. 2^10 across the columns: every block has its own exponent.
    x = torch.randn(16, 128, generator=gen) * torch.logspace(-6, 3, 128)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32)
    reference = to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    assert torch.equal(fake_quantize(x, RECIPES["mxfp8"]), reference)
    per_tensor = per_tensor_amax_to_scale(x.abs().amax())
    block_scales, packed = nvfp4_quantize(x, 16, per_tensor)
    values = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(16, -1, 16)
    reference = (values * block_scales.float().unsqueeze(-1) * per_tensor).reshape(x.shape)
    assert torch.equal(fake_quantize(x, RECIPES["nvfp4"]), reference)


def _llama(outlier: bool) -> torch.nn.Module:
    model = tiny_llama()
    if outlier:  # SwiGLU-style: the MLP input of one layer carries a channel 1000x the others
        with torch.no_grad():
            model.model.layers[OUTLIER_LAYER].post_attention_layernorm.weight[OUTLIER_CHANNEL] *= 1000
    return model


@pytest.fixture(scope="module")
def whatif_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    runs = {}
    for outlier in (True, False):
        model = _llama(outlier)
        out = root / ("outlier" if outlier else "plain")
        with probe.mode("whatif", out=str(out), model=model, recipes=["fp8-e4m3", "mxfp8"]) as session:
            train_steps(model, session, steps=2)
        runs[outlier] = out
    return runs


@pytest.mark.parametrize("recipe", ["fp8-e4m3", "mxfp8"])
def test_planted_outlier_channel_ranks_its_layers_mlp_first(whatif_runs, recipe):
    planted = f"model.layers.{OUTLIER_LAYER}.mlp"
    ranking = rank_matmuls(probe.load(whatif_runs[True]), recipe)
    assert ranking[0].module.startswith(planted), ranking[0].reason(recipe)
    assert ranking[0].flagged and f"underflow {recipe}" in ranking[0].reason(recipe)
    unflagged = [m.predicted_error for m in ranking if not m.flagged]
    assert unflagged and unflagged == sorted(unflagged, reverse=True)
    # Without the outlier, the same layer's MLP is not the riskiest: the ranking follows the plant.
    assert not rank_matmuls(probe.load(whatif_runs[False]), recipe)[0].module.startswith(planted)


def test_whatif_reads_forward_and_backward_operands_of_every_role(whatif_runs):
    ranking = rank_matmuls(probe.load(whatif_runs[True]), "mxfp8")
    roles = {(m.phase, o.role) for m in ranking for o in m.operands.values()}
    assert {("forward", "input"), ("forward", "weight"), ("backward", "grad_output"),
            ("backward", "weight"), ("backward", "input")} <= roles


def test_plan_file_round_trips_through_the_cli(whatif_runs, tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", str(whatif_runs[True]), "--recipe", "mxfp8", "--keep-fraction", "0.2",
                 "-o", str(path)]) == 0
    assert "keep" in capsys.readouterr().out
    written = Plan.load(path)
    made = plan(probe.load(whatif_runs[True]), "mxfp8", keep_fraction=0.2)
    assert written == made and written.recipe == RECIPES["mxfp8"]
    assert len(written.keep) == math.ceil(0.2 * len(written.ranking))
    assert set(written.keep).isdisjoint(written.quantize)
    assert [entry["op"] for entry in written.ranking[: len(written.keep)]] == list(written.keep)
    with pytest.raises(probe.ProbeError, match="recorded: \\['fp8-e4m3', 'mxfp8'\\]"):
        plan(probe.load(whatif_runs[True]), "nvfp4")


def test_fake_quant_with_an_empty_plan_is_bit_identical_and_a_full_one_is_not(tmp_path):
    model = _llama(True)
    plain = train_steps(model, steps=2)
    rng = torch.get_rng_state()
    traced_model = _llama(True)
    with probe.mode("fake_quant", out=str(tmp_path / "empty"), model=traced_model,
                    plan=Plan(RECIPES["mxfp8"])) as session:
        traced = train_steps(traced_model, session, steps=2)
    assert_trained_alike(model, plain, traced_model, traced, rng)
    quantized_model = _llama(True)
    with probe.mode("fake_quant", out=str(tmp_path / "all"), model=quantized_model, plan="all",
                    recipe="mxfp8") as session:
        quantized = train_steps(quantized_model, session, steps=2)
    assert not torch.equal(torch.stack(plain), torch.stack(quantized))


def test_convolutions_are_measured_and_fake_quantized_forward_and_backward(tmp_path):
    def conv_step(out, modes, **options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        x = torch.randn(2, 3, 8, 8)
        with probe.mode(modes, out=str(tmp_path / out), model=model, **options) as session:
            model(x).square().mean().backward()
            session.step()
        return model[0].weight.grad.clone()

    conv_step("whatif", "whatif", recipes=["mxfp8"])
    ranking = rank_matmuls(probe.load(tmp_path / "whatif"), "mxfp8")
    assert {(m.phase, m.name) for m in ranking} == {("forward", "aten.convolution.default"),
                                                    ("backward", "aten.convolution_backward.default")}
    backward = [m for m in ranking if m.phase == "backward"]
    assert {o.role for m in backward for o in m.operands.values()} == {"grad_output", "input", "weight"}
    plain = conv_step("plain", "structure")
    assert torch.equal(conv_step("empty", "fake_quant", plan=Plan(RECIPES["mxfp8"])), plain)
    assert not torch.equal(conv_step("all", "fake_quant", plan="all", recipe="mxfp8"), plain)


def test_sparse_operands_are_left_alone(tmp_path):
    # A sparse matmul operand has no blocks to quantize: measured and fake-quantized without it.
    sparse, dense = torch.randn(4, 32).to_sparse(), torch.randn(32, 4)
    modes = (("whatif", {"recipes": ["mxfp8"]}), ("fake_quant", {"plan": "all", "recipe": "mxfp8"}))
    for name, options in modes:
        with probe.mode(name, out=str(tmp_path / name), **options) as session:
            product = torch.mm(sparse, dense)
            session.step()
        assert product.shape == (4, 4)
    assert [m.name for m in rank_matmuls(probe.load(tmp_path / "whatif"), "mxfp8")] == ["aten.mm.default"]


_SUBSPACE = torch.randn(8, 48, generator=torch.Generator().manual_seed(2))


class _Products(torch.nn.Module):
    """Products whose output error an operand's own relative error misjudges: an outlier channel,
    a product that cancels (its input near a subspace its weight is orthogonal to), a batched
    product, and a strided grouped convolution."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w = torch.nn.Parameter(torch.randn(64, 48, generator=g))
        rows = torch.linalg.qr(_SUBSPACE.T).Q  # (48, 8): an orthonormal basis of the input's rows
        weight = torch.randn(64, 48, generator=g)
        self.cancelling = torch.nn.Parameter(weight - weight @ rows @ rows.T)
        self.conv = torch.nn.Conv2d(8, 6, 3, stride=2, groups=2, bias=False)

    def forward(self, x: torch.Tensor, near: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                image: torch.Tensor) -> list:
        return [torch.nn.functional.linear(x, self.w), torch.nn.functional.linear(near, self.cancelling),
                torch.bmm(q, k), self.conv(image)]


def _product_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(128, 48, generator=g)
    x[:, 0] *= 1000  # an outlier channel
    near = torch.randn(128, 8, generator=g) @ _SUBSPACE + 1e-2 * torch.randn(128, 48, generator=g)
    return (x, near, torch.randn(4, 16, 64, generator=g), torch.randn(4, 64, 16, generator=g),
            torch.randn(2, 8, 9, 9, generator=g))


@pytest.mark.parametrize("recipe", ["fp8-e4m3", "mxfp8"])
def test_predicted_error_is_the_products_measured_error(tmp_path, recipe):
    model = _Products()
    inputs = _product_inputs()
    with torch.no_grad(), probe.mode("whatif", out=str(tmp_path), model=model, recipes=[recipe]) as session:
        model(*inputs)
        session.step()
    run = probe.load(tmp_path)
    by_op = {m.op: m for m in rank_matmuls(run, recipe)}
    in_order = [by_op[op.id] for op in run.ops(0) if op.id in by_op]  # linear, linear, bmm, conv
    assert [m.name.split(".")[1] for m in in_order] == ["mm", "mm", "bmm", "convolution"]
    predicted = [m.predicted_error for m in in_order]
    x, near, q, k, image = inputs

    def quantized(t: torch.Tensor, reduction_dim: int = -1) -> torch.Tensor:
        """``t`` quantized-dequantized in blocks along ``reduction_dim``."""
        return fake_quantize(t.movedim(reduction_dim, -1), RECIPES[recipe]).movedim(-1, reduction_dim)

    def relative(exact: torch.Tensor, approximate: torch.Tensor) -> float:
        return float((approximate.double() - exact.double()).norm() / exact.double().norm())

    with torch.no_grad():
        w, cancelling, weight = model.w, model.cancelling, model.conv.weight
        measured = [relative(x @ w.T, quantized(x) @ quantized(w).T),
                    relative(near @ cancelling.T, quantized(near) @ quantized(cancelling).T),
                    relative(torch.bmm(q, k), torch.bmm(quantized(q), quantized(k, reduction_dim=1))),
                    relative(model.conv(image), torch.nn.functional.conv2d(
                        quantized(image, reduction_dim=1), quantized(weight, reduction_dim=1),
                        stride=2, groups=2))]
    # Rounding errors are nearly independent: the expectation lands within 30% of each product.
    assert predicted == pytest.approx(measured, rel=0.3)
    # An operand's own relative error alone misses the cancellation: the product's error is
    # its inputs' errors, not shrunk with the product.
    alone = math.sqrt(sum(o.relative_mse for o in in_order[1].operands.values()))
    assert measured[1] > 10 * alone
