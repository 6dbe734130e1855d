"""The recipe lab's worked example (docs/recipes.md): ``python docs/recipes_example.py [DIR]``.

A tiny LLaMA (random weights, CPU, nothing downloaded) whose layer 1 MLP input carries an outlier
channel (x1000) trains 3 steps under the whatif mode; ``probe plan`` ranks its matmuls for MXFP8
and writes plan.json; the plan and uniform MXFP8 are rerun under fake_quant and compared with the
high-precision run.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import probe

STEPS = 3


def model_with_outlier() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager"))
    with torch.no_grad():  # one channel of layer 1's MLP input x1000 (SwiGLU-style outlier)
        model.model.layers[1].post_attention_layernorm.weight[7] *= 1000
    return model


def train(out: Path, modes: object, **options: object) -> list[float]:
    """``STEPS`` AdamW steps under ``modes``; the losses."""
    model = model_with_outlier()
    losses = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with probe.mode(modes, out=str(out), model=model, **options) as session:
        for _ in range(STEPS):
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            session.step()
    return losses


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="recipes-"))
    reference = train(root / "reference", ["stats", "whatif"], recipes=["fp8-e4m3", "mxfp8", "nvfp4"])
    subprocess.run([sys.executable, "-m", "probe.cli", "plan", str(root / "reference"), "--recipe", "mxfp8",
                    "--keep-fraction", "0.1", "-o", str(root / "plan.json"), "--top", "5"], check=True)
    runs = {"planned": train(root / "planned", ["stats", "fake_quant"], plan=str(root / "plan.json")),
            "uniform": train(root / "uniform", ["stats", "fake_quant"], plan="all", recipe="mxfp8")}
    for name, losses in runs.items():
        drift = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        print(f"{name}: largest loss difference {drift:.2e}; compare: "
              f"{probe.compare(root / 'reference', root / name).conclusion}")


if __name__ == "__main__":
    main()
