#!/usr/bin/env bash
# Issue 16's GPU checks of the stats mode in one run (about 6-8 minutes on one H100/H200),
# written to benchmarks/results/cuda-stats.md: the CUDA tests, the overhead tables of the
# 7B-wide HF Llama (bf16, seq 2048) and of the small launch-bound HF Llama, with DebugMode
# beside them, then the peers (msprobe 26 where its venv is present), the floor (bytes the
# stats read per step / copy bandwidth) and a torch.profiler summary of one stats step.
#
#   bash benchmarks/cuda_stats_session.sh            # from the repository root
set -u
py=${PYTHON:-.venv/bin/python}
out=${OUT_FILE:-benchmarks/results/cuda-stats.md}
mkdir -p "$(dirname "$out")"
{
  echo "# Statistics mode on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  echo "$(date -u +%F) ; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo '## Tests'
  echo '```'
  timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_stats_batched.py 2>&1 | tail -4
  echo '```'
  echo
  echo '## hf-llama7b-width, bf16, seq 2048 (targets: stats <= 1.5x, below half of msprobe)'
  timeout 200 "$py" -m benchmarks.overhead --device cuda --model hf-llama7b-width \
    --configs probe-structure,probe-stats,debugmode --peers --steps 5 --warmup 2 --markdown 2>&1 | sed -n '/^|/p'
  echo
  echo '## hf-llama-small, fp32 (launch-bound; target: stats overhead at most half of msprobe)'
  timeout 100 "$py" -m benchmarks.overhead --device cuda --model hf-llama-small \
    --peers --steps 10 --warmup 2 --markdown 2>&1 | sed -n '/^|/p'
  echo
  echo '## Peers, floor and profile (hf-llama7b-width, bf16)'
  echo '```'
  timeout 200 "$py" -m benchmarks.stats_peers --device cuda --dtype bf16 --workload hf-llama7b-width \
    --steps 3 --profile 2>&1 | tail -45
  echo '```'
} > "$out" 2>&1
echo "written: $out"
