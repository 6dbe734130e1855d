#!/usr/bin/env bash
# The GPU checks of the stats mode in one run (about 8-10 minutes on one H100/H200),
# written to benchmarks/results/cuda-stats.md: the CUDA tests (the multi-tensor kernel's too), where a
# stats step's time goes (benchmarks.cuda_profile), the overhead tables of the
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
  timeout 150 "$py" -m pytest -q -p no:cacheprovider tests/test_multi_tensor_rows.py tests/test_cuda.py \
    tests/test_stats_batched.py tests/test_stats_exactness.py -k "cuda or CUDA" 2>&1 | tail -4
  echo '```'
  echo
  echo '## Where a stats step goes (bare, then stats_backend auto = the multi-tensor kernel; profile, kernel alone)'
  # (--backends auto,compiled adds the old per-tensor path for comparison: its first compile takes a minute)
  timeout 200 "$py" -m benchmarks.cuda_profile --backends auto --steps 4 --sections times,profile,kernel \
    --out "$(dirname "$out")" 2>&1 | sed -n '/^|/p;/^host time/p'
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
