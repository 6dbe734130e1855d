#!/usr/bin/env bash
# Issue 16's GPU rows beyond the statistics (benchmarks/cuda_stats_session.sh), for a session
# lent a device: the monitor (every decoder layer; every submodule's four slots) and the free
# benchmark (forward and backward add_noise, forward improve_precision) on the 7B-wide HF Llama
# (bf16, seq 2048), each ratio to baseline steps of the same process. About 5 minutes on an
# H100; run it in its own device call after the statistics script (one call is at most 10 min).
#
#   bash benchmarks/cuda_session.sh            # appends to benchmarks/results/cuda.md
set -u
py=${PYTHON:-.venv/bin/python}
out=${OUT_FILE:-benchmarks/results/cuda.md}
mkdir -p "$(dirname "$out")"
{
  echo "# Monitor and free benchmark on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "$(date -u +%F) ; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo '## Monitor, hf-llama7b-width (targets: submodules <= 1.05x, layers <= 1.02x)'
  timeout 150 "$py" -m benchmarks.monitor --device cuda --model hf-llama7b-width --configs layers,submodules \
    --steps 6 --warmup 2 --markdown 2>&1 | sed -n '/^|/p'
  echo
  echo '## Free benchmark, llama7b-shaped at seq 2048 (targets: forward <= 2x, backward <= 3x, memory <= 1.15x)'
  timeout 150 "$py" -m benchmarks.free_benchmark --device cuda --seq 2048 --steps 3 --rows 1,2,5 --markdown 2>&1 | sed -n '/^|/p'
} >> "$out" 2>&1
echo "appended: $out"
