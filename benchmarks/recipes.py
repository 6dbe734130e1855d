"""The recipe lab's benchmark: does the what-if ranking find a planted outlier channel, and does
the predicted risk of each matmul order the error that quantizing it alone really causes?

Run from the repository root::

    python -m benchmarks.recipes [--families llama,gpt2] [--recipes fp8-e4m3,mxfp8] [--markdown PATH]

For each family of the diagnosis benchmark (``benchmarks/diagnosis.py``'s tiny transformers
models, fp32, random weights), one layer's MLP input gets an outlier channel: the output of the
norm that feeds the MLP of block ``LAYER`` has channel 0 multiplied by 1000 (SwiGLU-style models
carry such channels, arXiv 2409.12517). One training step is recorded under the whatif mode, and
``probe.modes.recipes.ranking.rank_matmuls`` ranks the matmuls; the planted layer should come first.
Then each matmul's measured error: its output's relative L2 error with its operands alone
quantized-dequantized (every matmul of the step, in one pass), and with ``--gradient-families``
the relative L2 error of all parameter gradients when the fake_quant mode quantizes that matmul
alone (one rerun per matmul: minutes). The table gives, per family and recipe, whether the
top-ranked matmul lies in the planted block, and the Spearman rank correlations of the predicted
output error, and of the plan's order, with the measured errors (target >= 0.7).
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.diagnosis import FAMILIES, LAYER, Family

OUTLIER = 1000.0
VOCAB = 256

MLP_NORM = {
    "llama": "post_attention_layernorm", "mistral": "post_attention_layernorm",
    "qwen2": "post_attention_layernorm", "gemma": "post_attention_layernorm",
    "phi": "input_layernorm",  # phi's attention and MLP read the same norm (parallel block)
    "gpt2": "ln_2", "bert": "attention.output.LayerNorm", "t5": "layer.1.layer_norm",
    "vit": "layernorm_after",
}
"""Each family's norm whose output is the MLP's input, inside a block."""


def plant_outlier(model: torch.nn.Module, family: Family) -> str:
    """Multiply channel 0 of the MLP input of block ``LAYER`` by :data:`OUTLIER`; returns the block."""
    block = f"{family.layers}.{LAYER}"
    norm = model.get_submodule(f"{block}.{MLP_NORM[family.name]}")

    def outlier(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        scale = torch.ones(output.shape[-1], dtype=output.dtype, device=output.device)
        scale[0] = OUTLIER
        return output * scale

    norm.register_forward_hook(outlier)
    return block


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    def ranks(values: list[float]) -> np.ndarray:
        x = np.asarray(values, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for value in np.unique(x):  # average the ranks of ties
            tied = x == value
            r[tied] = r[tied].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _one_step(family: Family, out: Path, modes: Any, **options: Any) -> torch.Tensor:
    """One forward-backward of the planted model under ``modes``; all gradients, flattened."""
    import probe

    torch.manual_seed(0)
    model = family.build(VOCAB, "eager")
    plant_outlier(model, family)
    batch = family.batch(torch.Generator().manual_seed(1), VOCAB)
    with probe.mode(modes, out=str(out), model=model, **options) as session:
        model(**batch).loss.backward()
        session.step()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _first_tensor(out: Any) -> torch.Tensor:
    """An op's first tensor result (``convolution_backward`` returns None for a gradient it was
    not asked for)."""
    results = out if isinstance(out, (tuple, list)) else (out,)
    return next(r for r in results if isinstance(r, torch.Tensor))


class _OutputErrors(TorchDispatchMode):
    """Each matmul of a step, in order: the relative L2 error of its output when its operands
    alone are quantized-dequantized under each recipe (the op computed twice, nothing changed)."""

    def __init__(self, recipes: list[str]) -> None:
        super().__init__()
        self.recipes = recipes
        self.errors: list[dict[str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from probe.modes.recipes import RECIPES
        from probe.modes.recipes.operands import matmul_operands
        from probe.modes.recipes.quantize import fake_quantize

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        operands = list(matmul_operands(func._opname, args))
        if operands:
            exact = _first_tensor(out)
            errors = {}
            for recipe in self.recipes:
                quantized = list(args)
                for position, t, layout in operands:
                    reduced = layout.to_reduction_last(t)
                    quantized[position] = layout.back(fake_quantize(reduced, RECIPES[recipe]))
                result = _first_tensor(func(*quantized, **kwargs))
                errors[recipe] = float((result - exact).norm() / exact.norm().clamp(min=1e-30))
            self.errors.append(errors)
        return out


def _output_errors(family: Family, recipes: list[str]) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = family.build(VOCAB, "eager")
    plant_outlier(model, family)
    batch = family.batch(torch.Generator().manual_seed(1), VOCAB)
    with _OutputErrors(recipes) as mode:
        model(**batch).loss.backward()
    return mode.errors


def measure(family: Family, recipes: list[str], root: Path, gradient_error: bool,
            progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """The rows of one family: per recipe, the top-ranked matmul and the rank correlations."""
    import probe
    from probe.modes.recipes import RECIPES, Plan
    from probe.modes.recipes.operands import MATMUL_OPERANDS
    from probe.modes.recipes.ranking import rank_matmuls

    block = f"{family.layers}.{LAYER}"
    _one_step(family, root / "whatif", "whatif", recipes=recipes)
    run = probe.load(root / "whatif")
    # The step's matmuls in execution order, as the probe names them and as _OutputErrors sees them.
    order = [op.id for op in run.ops(0) if op.name.split(".")[1] in MATMUL_OPERANDS]
    local = dict(zip(order, _output_errors(family, recipes), strict=True))
    reference = _one_step(family, root / "reference", "structure") if gradient_error else None
    rows = []
    for recipe in recipes:
        ranking = rank_matmuls(run, recipe)
        output_errors = [local[m.op][recipe] for m in ranking]
        gradient_errors = []
        for i, matmul in enumerate(ranking if reference is not None else ()):
            progress(f"{family.name} {recipe} {i + 1}/{len(ranking)}")
            grads = _one_step(family, root / f"q{recipe}{i}", "fake_quant",
                              plan=Plan(RECIPES[recipe], quantize=(matmul.op,)))
            gradient_errors.append(float((grads - reference).norm() / reference.norm()))
        top = ranking[0]
        worst = max(range(len(ranking)), key=output_errors.__getitem__)
        rows.append({
            "family": family.name, "recipe": recipe, "matmuls": len(ranking),
            "planted_first": top.module.startswith(block + "."), "top": top.reason(recipe),
            "top_is_worst": worst == 0,
            "worst_output": f"{ranking[worst].module} ({ranking[worst].phase})",
            "spearman_output": _spearman([m.predicted_error for m in ranking], output_errors),
            "spearman_gradient": (_spearman([m.predicted_error for m in ranking], gradient_errors)
                                  if gradient_errors else None),
            "spearman_order": _spearman(list(range(len(ranking), 0, -1)), output_errors),
        })
    return rows


def _rho(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}"


def report(rows: list[dict[str, Any]], seconds: float, markdown: Path | None) -> str:
    lines = [
        "| family | recipe | matmuls | planted layer first | top-ranked has the largest output error "
        "| Spearman: predicted vs output error | ranking order vs output error "
        "| predicted vs gradient error | top-ranked (reason) | largest output error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        first, worst = ("yes" if r[key] else "no" for key in ("planted_first", "top_is_worst"))
        rhos = " | ".join(_rho(r[key]) for key in ("spearman_output", "spearman_order", "spearman_gradient"))
        lines.append(f"| {r['family']} | {r['recipe']} | {r['matmuls']} | {first} | {worst} | {rhos} "
                     f"| {r['top']} | {r['worst_output']} |")
    first_count = sum(r["planted_first"] for r in rows)
    good = sum(r["spearman_output"] >= 0.7 for r in rows)
    top_worst = sum(r["top_is_worst"] for r in rows)
    summary = (f"planted layer first in {first_count} of {len(rows)}; the top-ranked matmul has the largest "
               f"output error in {top_worst} of {len(rows)}; Spearman of predicted vs output error "
               f">= 0.7 in {good} of {len(rows)}; {seconds:.0f} s, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads")
    text = "\n".join(lines) + "\n\n" + summary + "\n"
    if markdown is not None:
        markdown.write_text(
            "# Recipe lab: planted outlier channel and risk vs measured error\n\n"
            "`python -m benchmarks.recipes --gradient-families llama "
            "--markdown benchmarks/results/recipes.md` "
            "(see the module docstring). Outlier: channel 0 of block 1's MLP input x1000. Output error: the "
            "relative L2 error of a matmul's output with its operands alone quantized-dequantized; gradient "
            "error: of all parameter gradients of the step with that matmul alone fake-quantized. Ranking "
            "order: the plan's order (flagged first), predicted: its predicted output error alone."
            "\n\n" + text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families")
    parser.add_argument("--recipes", default="fp8-e4m3,mxfp8", help="comma-separated recipes")
    parser.add_argument("--gradient-families", default="",
                        help="families whose gradient error is measured too (one rerun per matmul: minutes)")
    parser.add_argument("--markdown", type=Path, default=None, help="write the table there too")
    args = parser.parse_args(argv)
    gradient_families = set(args.gradient_families.split(","))
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in families:
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(FAMILIES[name], args.recipes.split(","), Path(tmp), name in gradient_families)
        print(f"{name}: " + ", ".join(f"{r['recipe']} first={r['planted_first']} "
                                      f"rho={_rho(r['spearman_output'])}/{_rho(r['spearman_gradient'])}"
                                      for r in rows if r["family"] == name), flush=True)
    print(report(rows, time.perf_counter() - start, args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
