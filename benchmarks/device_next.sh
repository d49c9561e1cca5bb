#!/usr/bin/env bash
# The measurements waiting for a lent GPU (issues 48 and 49), one step per device call:
#
#   bash benchmarks/device_next.sh gemma8k      Gemma 3's architecture (random weights) at 8K: compiled
#                                                flex against exact windows and the recipe, torch.compile's
#                                                default mode and mode="reduce-overhead", in rounds
#   bash benchmarks/device_next.sh pisa_scores   PISA's walks in fp32 / bf16 / tf32: time and contract
#   bash benchmarks/device_next.sh windows       the window tests of every method on the GPU
#
# Each writes under $OUT (the device call's folder) and prints its table.
set -euo pipefail
out=${OUT:-.device_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
plan=benchmarks/results/gemma3_plan_32k_h100.json

case "${1:-}" in
  gemma8k)
    # default mode against compiled flex, then reduce-overhead on the sparseflow rows (flex's own
    # first call under reduce-overhead costs minutes); a row that times out leaves the other
    timeout 330 python3 benchmarks/gemma3_e2e.py --random --ns 8192 --rows flex_compile,windows,recipe \
      --recipe "$plan" --reps 8 --rounds 3 --json "$out/gemma3_random_8k_default_${gpu}.json" \
      2>&1 | grep -v -i warn | tail -4 || true
    timeout 220 python3 benchmarks/gemma3_e2e.py --random --ns 8192 --rows windows,recipe \
      --recipe "$plan" --mode reduce-overhead --reps 8 --rounds 3 \
      --json "$out/gemma3_random_8k_reduce-overhead_${gpu}.json" 2>&1 | grep -v -i warn | tail -4 || true
    ;;
  pisa_scores)
    timeout 580 python3 benchmarks/studies/pisa_walk_precision.py --json "$out/pisa_walk_precision_${gpu}.json"
    ;;
  windows)
    timeout 580 python3 -m pytest -q -p no:cacheprovider tests/methods/bsa/test_bsa_window.py \
      tests/methods/pbs/test_pbs_window.py tests/methods/pisa/test_pisa_window.py \
      tests/methods/dense/test_dense_window.py tests/kernels/test_token_sparse_window.py 2>&1 | tail -5
    ;;
  *)
    echo "usage: $0 gemma8k | pisa_scores | windows" >&2
    exit 2
    ;;
esac
