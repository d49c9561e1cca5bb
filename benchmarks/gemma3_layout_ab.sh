#!/usr/bin/env bash
# The op's output layout before and after, end to end on Gemma 3 270M's architecture (random
# weights: speed only; the outputs' values do not depend on the layout), each side beside its own
# compiled-flex baseline in gemma3_e2e's interleaved rounds.
#
#   here, once:  git worktree add --detach .base <the commit before the change>   (list /.base/ in
#                .git/info/exclude)
#   there:       bash benchmarks/gemma3_layout_ab.sh N [ROUNDS]    (the call carries .base)
set -euo pipefail
n=$1
rounds=${2:-5}
out=${OUT:-.device_out}
mkdir -p "$out"
plan=benchmarks/results/gemma3_plan_32k_h100.json
for side in base new; do
  root=$PWD
  if [ "$side" = base ]; then root=$PWD/.base; fi
  # a cache of its own for each side: Inductor's FX graph cache does not key on an op's fake
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=$root python3 benchmarks/gemma3_e2e.py --random --ns "$n" \
    --rows flex_compile,windows,recipe --recipe "$plan" --reps 10 --rounds "$rounds" \
    --json "$out/gemma3_layout_${side}_${n}.json"
done
