"""Cost of compiled="keep" (issue 24 item 5): a torch.compile'd Qwen2 (tiny config, fp32, AdamW)
trained plainly, under the probe with compiled="keep" (each compiled region recorded and its
graph re-run node by node), and under the default compiled="eager" (the compiled code run
eagerly, every op traced). Seconds per step, median of the timed steps after warm-up (which
compiles). CPU by default.

    .venv/bin/python -m benchmarks.compiled_keep [--steps N] [--hidden H] [--seq S]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import probe


def _model(hidden: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="eager")
    return transformers.Qwen2ForCausalLM(config)


def _steps(model: torch.nn.Module, steps: int, seq: int, session: probe.Session | None) -> list[float]:
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, seq), generator=gen)
        start = time.perf_counter()
        compiled(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if session is not None:
            session.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    warm = 2  # the first steps compile (forward, then backward)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, policy in (("plain compiled", None), ("probe stats, compiled='keep'", "keep"),
                              ("probe stats, compiled='eager' (default)", "eager")):
            torch._dynamo.reset()
            model = _model(args.hidden)
            if policy is None:
                times = _steps(model, args.steps + warm, args.seq, None)
            else:
                with probe.mode("stats", out=Path(tmp) / policy, model=model, compiled=policy) as session:
                    times = _steps(model, args.steps + warm, args.seq, session)
            rows.append((label, statistics.median(times[warm:])))
    base = rows[0][1]
    print(f"Qwen2 2 layers, hidden {args.hidden}, batch 4x{args.seq}, fp32, AdamW, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| run | s/step | x plain compiled |\n| --- | --- | --- |")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.4f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
