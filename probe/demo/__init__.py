"""A built-in tiny LLaMA-style model and a training loop for ``probe demo`` and the benchmarks."""
