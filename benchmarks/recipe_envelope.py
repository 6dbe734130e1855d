"""Does a recipe-lab plan hold over a run? The loss of k training steps with the plan's matmuls
fake-quantized, against the envelope a healthy low-precision run draws around the fp32 run.

Run from the repository root::

    python -m benchmarks.recipe_envelope [--steps 50] [--seeds 3] [--recipes mxfp8,nvfp4]
                                         [--keep-fraction 0.2] [--markdown PATH]

Per data seed, a tiny LLaMA (the worked example's: random weights, layer 1's MLP input with one
channel x1000, SwiGLU-style) learns a small corpus (``CORPUS`` random sequences it can memorize,
batches drawn from them: a loss that falls, so that what a recipe does to the gradients shows
in it) for ``--steps`` AdamW steps, several ways from the same start and the same batches:
fp32 (the reference), bf16 autocast (the healthy envelope: its largest loss difference from
fp32 over the steps), and per recipe: every matmul fake-quantized
(uniform), and the plan's matmuls only (the plan: ``probe plan`` of a whatif run of the first
two steps, the riskiest ``--keep-fraction`` kept in high precision). The issue's target: where
uniform drifts beyond the envelope, the plan stays within it with at least 80% of the matmuls
quantized.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB, BATCH, SEQ, LR, CORPUS = 128, 4, 32, 3e-3, 16
OUTLIER = 1000.0
"""The outlier channel's factor by default (``--outlier``)."""


def model_with_outlier(outlier: float = OUTLIER) -> torch.nn.Module:
    """The worked example's model (docs/recipes_example.py), its outlier channel ``outlier`` times
    the rest."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"))
    with torch.no_grad():  # one channel of layer 1's MLP input x1000 (SwiGLU-style outlier)
        model.model.layers[1].post_attention_layernorm.weight[7] *= outlier
    return model


def train(steps: int, seed: int, out: Path | None = None, modes: Any = None, autocast: bool = False,
          outlier: float = OUTLIER, **options: Any) -> list[float]:
    """``steps`` AdamW steps (under ``modes`` when given); the losses."""
    import probe

    model = model_with_outlier(outlier)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(seed)
    corpus = torch.randint(0, VOCAB, (CORPUS, SEQ), generator=gen)
    session = (probe.mode(modes, out=str(out), model=model, **options) if modes is not None
               else contextlib.nullcontext())
    losses = []
    with session as s:
        for _ in range(steps):
            ids = corpus[torch.randint(0, CORPUS, (BATCH,), generator=gen)]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            if s is not None:
                s.step()
    return losses


def largest_difference(losses: list[float], reference: list[float]) -> float:
    """The largest loss difference over the steps (absolute: the loss falls towards 0)."""
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def measure(steps: int, seed: int, recipes: list[str], keep_fraction: float,
            root: Path, outlier: float = OUTLIER) -> list[dict[str, Any]]:
    import probe
    from probe.modes.recipes.ranking import write_plan

    reference = train(steps, seed, outlier=outlier)
    envelope = largest_difference(train(steps, seed, autocast=True, outlier=outlier), reference)
    train(2, seed, root / "whatif", "whatif", outlier=outlier, recipes=recipes)
    rows = []
    for recipe in recipes:
        plan, path = write_plan(probe.load(root / "whatif"), recipe, root / f"plan-{recipe}.json",
                                keep_fraction=keep_fraction)
        uniform = train(steps, seed, root / f"uniform-{recipe}", "fake_quant", outlier=outlier,
                        plan="all", recipe=recipe)
        planned = train(steps, seed, root / f"planned-{recipe}", "fake_quant", outlier=outlier,
                        plan=str(path))
        quantized = len(plan.quantize) / (len(plan.quantize) + len(plan.keep))
        rows.append({"seed": seed, "recipe": recipe, "envelope": envelope,
                     "uniform": largest_difference(uniform, reference),
                     "planned": largest_difference(planned, reference), "quantized": quantized})
    return rows


def report(rows: list[dict[str, Any]], steps: int, keep_fraction: float, seconds: float) -> str:
    lines = ["| seed | recipe | bf16 autocast envelope | uniform | plan | matmuls quantized by the plan | "
             "uniform beyond the envelope | plan within it |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        beyond, within = r["uniform"] > r["envelope"], r["planned"] <= r["envelope"]
        lines.append(f"| {r['seed']} | {r['recipe']} | {r['envelope']:.2e} | {r['uniform']:.2e} | "
                     f"{r['planned']:.2e} | {100 * r['quantized']:.0f}% | {'yes' if beyond else 'no'} | "
                     f"{'yes' if within else 'no'} |")
    held = sum(r["uniform"] > r["envelope"] and r["planned"] <= r["envelope"] for r in rows)
    drifting = sum(r["uniform"] > r["envelope"] for r in rows)
    lines.append("")
    lines.append(f"Largest loss difference from fp32 over {steps} steps. Uniform beyond the "
                 f"envelope in {drifting} of {len(rows)}; of those, the plan (keep fraction {keep_fraction}) "
                 f"within it in {held}. {seconds:.0f} s, torch {torch.__version__}, "
                 f"{torch.get_num_threads()} threads.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--recipes", default="mxfp8,nvfp4")
    parser.add_argument("--keep-fraction", type=float, default=0.2)
    parser.add_argument("--outlier", type=float, default=OUTLIER,
                        help="the outlier channel's factor (the worked example's: 1000)")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(args.steps, seed, args.recipes.split(","), args.keep_fraction, Path(tmp),
                            args.outlier)
        print(f"seed {seed} done", flush=True)
    text = report(rows, args.steps, args.keep_fraction, time.perf_counter() - start)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(
            "# Recipe lab: does the plan hold over a run?\n\n"
            f"`python -m benchmarks.recipe_envelope --steps {args.steps} --seeds {args.seeds} --recipes "
            f"{args.recipes} --keep-fraction {args.keep_fraction}` (see the module docstring).\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
