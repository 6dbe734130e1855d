"""What the checksums mode (always on with ``model=``) costs a training step.

Run from the repository root::

    python -m benchmarks.checksums [--model demo|llama7b-shaped] [--steps N] [--device cpu|cuda|npu]

Times, on one model (``benchmarks.models``):

- ``step``: a training step, no probe (the median of ``--steps``);
- ``parameters``: checksumming every parameter once (what the first step of a session
  does, and every step with ``checksums=[..., "parameters_each_step"]``);
- ``inputs + rng``: what every recorded step does by default (the batch's checksum and
  the generators' states);
- ``session default`` / ``session each step``: a step inside ``probe.mode("checksums",
  model=...)`` in one long session (its first step not timed), with the default kinds
  and with parameters each step, ``session.step()`` included.

Components are timed on their own (synchronised, medians) because a fraction of a
percent is below the noise of whole CPU steps; the session rows check the total.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import probe
from benchmarks.models import MODELS
from probe.demo.model import synthetic_batch
from probe.demo.train import DemoTraining
from probe.modes.checksums.bit_checksum import ChecksumCache
from probe.modes.checksums.mode import _Queued, _rng_states


def _median_ms(run: Callable[[], None], trainer: DemoTraining, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        trainer.synchronize()
        start = time.perf_counter()
        run()
        trainer.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _session_ms(plain: DemoTraining, probed: DemoTraining, steps: int, kinds: list[str]
                ) -> tuple[float, float]:
    """Median step times of ``plain`` and of ``probed`` in one long checksums session, alternating
    (like benchmarks.monitor) so that both see the same machine; the session's first step (which
    checksums the parameters whatever the kinds) is not timed."""
    def timed(trainer: DemoTraining, after: Callable[[], None]) -> float:
        trainer.synchronize()
        start = time.perf_counter()
        trainer.step()
        after()
        trainer.synchronize()
        return time.perf_counter() - start

    base: list[float] = []
    times: list[float] = []
    with tempfile.TemporaryDirectory(prefix="probe-checksums-") as out, \
            probe.mode("checksums", out=Path(out) / "run", model=probed.model, checksums=kinds) as session:
        for i in range(steps + 1):
            pair = (timed(plain, lambda: None), timed(probed, session.step)) if i % 2 else \
                tuple(reversed((timed(probed, session.step), timed(plain, lambda: None))))
            if i:
                base.append(pair[0])
                times.append(pair[1])
    return 1e3 * statistics.median(base), 1e3 * statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checksums",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="demo")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    trainer = spec.trainer(device=args.device)
    params = [(name, p) for name, p in trainer.model.named_parameters()]
    cache = ChecksumCache()
    data = torch.Generator().manual_seed(0)
    batch = synthetic_batch(spec.config, spec.batch, spec.seq, data).to(args.device)

    def parameters() -> None:
        _Queued.of(params, cache).to_json()

    def inputs_and_rng() -> None:
        _rng_states()
        _Queued.of([("args[0]", batch)], cache).to_json()

    trainer.step()  # warm-up
    step = _median_ms(trainer.step, trainer, args.steps)
    rows = [
        ("parameters (once a session; each step with parameters_each_step)",
         _median_ms(parameters, trainer, args.steps), step),
        ("inputs + rng (each step)", _median_ms(inputs_and_rng, trainer, max(args.steps, 20)), step),
    ]
    probed = spec.trainer(device=args.device)
    for label, kinds in (("default", ["parameters", "inputs", "rng"]),
                         ("parameters_each_step", ["parameters_each_step", "inputs", "rng"])):
        base, ms = _session_ms(trainer, probed, args.steps, kinds)
        rows.append((f"session step, {label} (plain {base:.1f} ms)", ms - base, base))
    print(f"{spec.name} ({spec.describe()}) on {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.steps}; a plain step {step:.1f} ms")
    print("| what | ms | % of a step |\n|---|---:|---:|")
    for name, ms, reference in rows:
        print(f"| {name} | {ms:+.2f} | {100 * ms / reference:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
