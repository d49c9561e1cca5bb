#!/usr/bin/env bash
# The measurements waiting for a lent GPU (issues 48 and 49), one step per device call:
#
#   bash benchmarks/device_next.sh gemma8k      Gemma 3's architecture (random weights) at 8K: compiled
#                                                flex against exact windows and the recipe, torch.compile's
#                                                default mode and mode="reduce-overhead", in rounds
#   bash benchmarks/device_next.sh gemma_profile32k  Gemma 3's architecture (random weights) at 32K: one
#                                                profiled forward of compiled flex and of exact windows,
#                                                kernels by time (what the MLPs and projections take)
#   bash benchmarks/device_next.sh estimate_cost PBS's estimate + selection stage against cuDNN at 32K / 128K
#                                                on SmolLM2's heads: strides 8, 16, 32 and mean scoring
#   bash benchmarks/device_next.sh gemma32k      Gemma 3's architecture (random weights) at 32K: compiled flex
#                                                against exact windows and the recipe, in rounds (the
#                                                windows' 128-row launch from head dim 256)
#   bash benchmarks/device_next.sh window_launch Gemma 3's sliding-window kernel alone: dot rows, warps, stages
#                                                and window blocks side by side, beside compiled flex
#   bash benchmarks/device_next.sh pisa_scores   PISA's walks in fp32 / bf16 / tf32: time and contract
#   bash benchmarks/device_next.sh pisa_walks    the per-token and the leaf-pairs walk in bf16 from 64K to 1M
#                                                beside the BSA scans (paper's latency setting), then
#                                                their contract at 64K / 256K
#   bash benchmarks/device_next.sh windows       the window tests of every method on the GPU
#   bash benchmarks/device_next.sh reduce_overhead   mode="reduce-overhead": the GPU tests (every
#                                                method, the window lists kept during Inductor's
#                                                warm-up), then Gemma 3 at 8K beside compiled flex
#   bash benchmarks/device_next.sh pisa_decode   PISA's decode step at 32K / 128K (K=32), its walk scoring
#                                                in bf16 on 4 and 8 warps, per token and with its leaf
#                                                level split off, against dense SDPA decode
#   bash benchmarks/device_next.sh pisa_train    PISA's forward + backward at 16K / 32K (K=8): the kernels,
#                                                sparseflow.attention (selects once) and the op's recomputing
#                                                backward, against cuDNN's
#   bash benchmarks/device_next.sh first_call    one call's worth of the checks above that need no checkpoint:
#                                                PISA's walks (selection), its decode walks, PBS's
#                                                estimate by stride, Gemma 3's 32K profile
#   SmolLM2's real checkpoint, one part a call on one warm machine (GGUF halves of 49 MB):
#   bash benchmarks/device_next.sh split_smollm2     here, once: .gg/smollm2.part0/1 and the gguf wheel
#   bash benchmarks/device_next.sh stash_smollm2 K   carry .gg/smollm2.partK (and .whl with K=0)
#   bash benchmarks/device_next.sh pisa_e2e [NS [TUNING [TUNING2]]]  SmolLM2 (YaRN to NS, default 131072)
#                                                through sparseflow.compile: PISA and BSA K=8, PISA's walk auto,
#                                                then PISA with TUNING (default pisa_walk=leaf_pairs,pisa_scores=bf16)
#                                                and TUNING2 if given
#   bash benchmarks/device_next.sh pisa_real_layers  PISA's contract on SmolLM2's real layers at 8K and 32K,
#                                                the auto walk scoring in bf16 and tf32
#   bash benchmarks/device_next.sh frontier [NS]     every estimate and threshold, both paths
#                                                (benchmarks/frontier.py; NS default 32768)
#   bash benchmarks/device_next.sh calibrate [NS [BUDGET [SCORINGS [THRESHOLDS]]]]  sparseflow calibrate at NS tokens (default
#                                                32768; YaRN to NS, cost "time", the default text
#                                                mix, held out on prose and copy-heavy text); resumes
#                                                from .gg/calibrate_smollm2_pbs_NS_GPU.json.progress.json
#                                                when carried (the grid is not part of its key: a run
#                                                with more SCORINGS measures only the new choices)
#   bash benchmarks/device_next.sh frontier_plan PLAN [NS]   the recipe, sampled_rows 0.98 and a
#                                                calibrated PLAN side by side, both paths
#   bash benchmarks/device_next.sh selection_rule [NS]   the estimate (strides 8, 16, 32; the pooled
#                                                mean and second-moment estimates) against exact block
#                                                masses, and the mass rule against a max-relative one, at NS
#                                                (benchmarks/studies/pbs_selection_rule.py; 32768)
#   bash benchmarks/device_next.sh moments_cost  PBS's scoring="moments" (the pooled blocks' means plus
#                                                the pairs' spread): its tests on the GPU, its stage
#                                                beside mean scoring against cuDNN on SmolLM2's and
#                                                Gemma 3's heads (no checkpoint: fits beside stash_smollm2 0)
#   bash benchmarks/device_next.sh moments_frontier [NS]  the frontier at NS (32768) of mean and moments
#                                                at three thresholds, both paths
#   bash benchmarks/device_next.sh moments_profile [NS]  the moments stage's kernels by time beside mean
#                                                scoring's (benchmarks/studies/pbs_moments_profile.py)
#   bash benchmarks/device_next.sh pisa_profile [NS]  PISA's selection kernels by time at NS (262144),
#                                                the leaf-pairs, per-token and tiled walks in bf16, paper's setting
#                                                (benchmarks/studies/pisa_select_profile.py); then
#                                                SmolLM2's heads at 32K: the scan walk beside BSA's scan
#   bash benchmarks/device_next.sh pisa_tests    PISA's walk tests compiled on the GPU (leaf pairs with the fp32
#                                                walk's three bf16 parts, scan, offsets past 2**31 elements,
#                                                the contract): first after a change the CPU could only compile
#   bash benchmarks/device_next.sh pisa_tests_quick  pisa_tests' leaf-pairs, precision and offsets files and the
#                                                scan's rows walk: what fits beside a study in one call
#   bash benchmarks/device_next.sh pisa_fma     PISA's leaf pairs with an eighth of their exponentials on the FMA units
#                                                against none, in rounds (benchmarks/studies/pisa_fma_exps.py)
#   bash benchmarks/device_next.sh pisa_regs     PISA's leaf-pairs walk with its walk kernel capped at 96 and 80
#                                                registers a thread (more programs an SM) against none, in
#                                                rounds (benchmarks/studies/pisa_walk_registers.py)
#   bash benchmarks/device_next.sh pisa_scan_profile  the scan's kernels by time on SmolLM2's heads (32K bf16 /
#                                                fp32, 8K fp32), its heads' layout "auto" beside "packed",
#                                                BSA's bf16 scan beside them
#   bash benchmarks/device_next.sh pisa_rows     PISA's selection beside BSA's bf16 scan on six shapes
#                                                (benchmarks/studies/pisa_select_rows.py: checksums of the
#                                                selections), the 256K profile, then the contract in fp32,
#                                                bf16 and tf32 at 64K / 256K (pisa_walk_precision.py)
#
# Each writes under $OUT (the device call's folder) and prints its table.
set -euo pipefail
out=${OUT:-.device_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpu=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu) | head -1 | tr ' ' '_')
plan=benchmarks/results/gemma3_plan_32k_h100.json
smollm2=/tmp/smollm2

smollm2_env() {  # the joined GGUF and the gguf wheel on this machine
  if [ ! -f $smollm2/model.gguf ]; then
    cat $smollm2/part0 $smollm2/part1 > $smollm2/model.gguf
  fi
  export SPARSEFLOW_SMOLLM2_GGUF=$smollm2/model.gguf HF_HUB_OFFLINE=1 PYTHONPATH="$PYTHONPATH:$smollm2/site"
}

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
  first_call)
    timeout 170 python3 benchmarks/pisa.py --part select --walk leaf_pairs,per_token --select-scores bf16 \
      --select-ns 65536,262144,1048576 --json "$out/pisa_select_leaf_pairs_${gpu}.json" 2>&1 | tail -8 || true
    timeout 130 python3 benchmarks/pisa.py --part decode --decode-ns 131072 --decode-scores bf16 \
      --decode-warps auto,8 --decode-walks auto,leaf_pairs --json "$out/pisa_decode_walks_${gpu}.json" \
      2>&1 | grep "^decode" || true
    timeout 120 python3 benchmarks/check_pbs_estimate_cuda.py --check-n 4096 --strides 8,16,32 \
      --time-n 32768,131072 --time-scorings sampled_rows,mean --heads 9,3,64 \
      --json "$out/pbs_estimate_strides_smollm2_${gpu}.json" 2>&1 | grep -v "other tiles" | tail -12 || true
    timeout 150 python3 benchmarks/gemma3_profile.py --random --n 32768 --rows flex_compile,windows \
      --top 12 --json "$out/gemma3_profile_32k_${gpu}.json" 2>&1 | grep -v -i warn | tail -40 || true
    ;;
  gemma32k)
    timeout 560 python3 benchmarks/gemma3_e2e.py --random --ns 32768 --rows flex_compile,windows,recipe \
      --recipe "$plan" --reps 5 --rounds 3 --json "$out/gemma3_random_32k_wide_tiles_${gpu}.json" \
      2>&1 | grep -v -i warn | tail -6 || true
    ;;
  window_launch)
    timeout 560 python3 benchmarks/studies/window_kernel_launch.py --ns 32768 \
      --json "$out/window_kernel_launch_${gpu}.json" 2>&1 | grep -v -i warn | tail -30 || true
    ;;
  gemma_profile32k)
    timeout 500 python3 benchmarks/gemma3_profile.py --random --n 32768 --rows flex_compile,windows,recipe \
      --recipe "$plan" --top 16 --json "$out/gemma3_profile_32k_${gpu}.json" 2>&1 | grep -v -i warn | tail -80 || true
    ;;
  estimate_cost)
    timeout 400 python3 benchmarks/check_pbs_estimate_cuda.py --check-n 4096 --strides 8,16,32 \
      --time-n 32768,131072 --time-scorings sampled_rows,mean --heads 9,3,64 \
      --json "$out/pbs_estimate_strides_smollm2_${gpu}.json" 2>&1 | grep -v "other tiles" | tail -20 || true
    ;;
  pisa_walks)
    timeout 330 python3 benchmarks/pisa.py --part select --walk leaf_pairs,per_token --select-scores bf16 \
      --select-ns 65536,262144,1048576 --json "$out/pisa_select_leaf_pairs_${gpu}.json" 2>&1 | tail -12 || true
    timeout 240 python3 benchmarks/studies/pisa_walk_precision.py --walks leaf_pairs,per_token --scores bf16 \
      --ns 65536,262144 --check-rows 64 --json "$out/pisa_walk_leaf_pairs_${gpu}.json" 2>&1 | tail -6 || true
    ;;
  pisa_tests)
    timeout 580 python3 -m pytest -q -p no:cacheprovider tests/methods/pisa/test_pisa_leaf_pairs.py \
      tests/methods/pisa/test_pisa_scan.py tests/methods/pisa/test_pisa_offsets.py \
      tests/methods/pisa/test_pisa_walk_precision.py 2>&1 | tail -8
    ;;
  pisa_tests_quick)
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/methods/pisa/test_pisa_leaf_pairs.py \
      tests/methods/pisa/test_pisa_walk_precision.py tests/methods/pisa/test_pisa_offsets.py \
      "tests/methods/pisa/test_pisa_scan.py::test_rows_walk_by_other_query_counts_keeps_the_reference" 2>&1 | tail -8
    ;;
  pisa_fma)
    timeout 400 python3 benchmarks/studies/pisa_fma_exps.py --json "$out/pisa_fma_exps_${gpu}.json" 2>&1 | grep "^n=" || true
    ;;
  pisa_regs)
    timeout 400 python3 benchmarks/studies/pisa_walk_registers.py --caps 0,96,80 \
      --json "$out/pisa_walk_registers_${gpu}.json" 2>&1 | grep "^n=" || true
    ;;
  pisa_scores)
    timeout 580 python3 benchmarks/studies/pisa_walk_precision.py --json "$out/pisa_walk_precision_${gpu}.json"
    ;;
  windows)
    timeout 580 python3 -m pytest -q -p no:cacheprovider tests/methods/bsa/test_bsa_window.py \
      tests/methods/pbs/test_pbs_window.py tests/methods/pisa/test_pisa_window.py \
      tests/methods/dense/test_dense_window.py tests/kernels/test_token_sparse_window.py 2>&1 | tail -5
    ;;
  reduce_overhead)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_compile_cuda.py \
      "tests/kernels/test_token_window_blocks.py::test_window_lists_kept_during_inductors_graph_warm_up_stay_out_of_its_pool" \
      2>&1 | tail -6 || true
    timeout 280 python3 benchmarks/gemma3_e2e.py --random --ns 8192 --rows flex_compile,windows,recipe \
      --recipe "$plan" --mode reduce-overhead --reps 8 --rounds 3 \
      --json "$out/gemma3_random_8k_reduce-overhead_${gpu}.json" 2>&1 | grep -v -i warn | tail -8 || true
    ;;
  pisa_decode)
    # the walk is latency-bound at decode (one program per KV head): its width in warps, and its
    # leaf level split off over many programs (pisa_walk="leaf_pairs"), side by side
    timeout 580 python3 benchmarks/pisa.py --part decode --decode-ns 32768,131072 --decode-scores bf16 \
      --decode-warps auto,8 --decode-walks auto,leaf_pairs --json "$out/pisa_decode_walks_${gpu}.json"
    ;;
  pisa_train)
    timeout 580 python3 benchmarks/pisa.py --part attn --attn-ns 16384,32768 --attn-k 8 \
      --json "$out/pisa_train_${gpu}.json"
    ;;
  split_smollm2)
    gguf=$(python3 -c "from sparseflow.checkpoints import smollm2_gguf; print(smollm2_gguf() or '')")
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    mkdir -p .gg .whl
    head -c "$half" "$gguf" > .gg/smollm2.part0
    tail -c +"$((half + 1))" "$gguf" > .gg/smollm2.part1
    [ -n "$(ls .whl/gguf-*.whl 2>/dev/null)" ] || python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
    ls -la .gg .whl
    ;;
  stash_smollm2)
    mkdir -p $smollm2
    cp ".gg/smollm2.part$2" "$smollm2/part$2"
    if [ -n "$(ls .whl/gguf-*.whl 2>/dev/null)" ] && [ ! -d $smollm2/site/gguf ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $smollm2/site .whl/gguf-*.whl
    fi
    ls -la $smollm2
    ;;
  pisa_e2e)
    smollm2_env
    ns=${2:-131072}
    limit=280; [ -n "${4:-}" ] && limit=190  # three runs share the call's 10 minutes
    timeout $limit python3 benchmarks/e2e_prefill.py --ns "$ns" --ropes yarn --settings pisa,bsa --paths compile \
      --reps 3 --json "$out/e2e_pisa_bsa_${ns}_${gpu}.json" 2>&1 | grep -v -i warn | tail -8 || true
    for tuning in "${3:-pisa_walk=leaf_pairs,pisa_scores=bf16}" ${4:-}; do
      timeout $limit python3 benchmarks/e2e_prefill.py --ns "$ns" --ropes yarn --settings pisa --paths compile \
        --reps 3 --tuning "$tuning" \
        --json "$out/e2e_pisa_$(echo "$tuning" | tr ',=' '__')_${ns}_${gpu}.json" 2>&1 | grep -v -i warn | tail -8 || true
    done
    ;;
  pisa_real_layers)
    smollm2_env
    timeout 570 python3 benchmarks/studies/pisa_real_layers_gpu.py --ns 8192,32768 \
      --json "$out/pisa_real_layers_${gpu}.json" 2>&1 | grep "^N=" || true
    ;;
  frontier)
    smollm2_env
    timeout 580 python3 benchmarks/frontier.py --ns "${2:-32768}" --estimates sampled_rows,antidiagonal \
      --thresholds 0.95,0.98 --json "$out/frontier_smollm2_${2:-32768}_${gpu}.json" \
      2>&1 | grep -v -i warn | tail -40
    ;;
  calibrate)
    smollm2_env
    ns=${2:-32768}
    file="calibrate_smollm2_pbs_${ns}_${gpu}.json"
    # the budget holds the plan's KL on the mix's worst text (copy-heavy) with margin 0.7: at 32K
    # budget 0.025 measured 0.0156 there and 0.0085 on prose (docs/results.md, fifteenth session)
    texts=() grid=() budget=${3:-0.025} heldout=stdlib_docs,more_stdlib_source,copy_log
    # past 119K tokens pydoc_topics (the default mix's prose) is too short: documentation and
    # clauses, held out on source and logs; the 128K target is KL 0.02 on prose, about half the
    # copy-heavy text's at 32K, hence budget 0.05 (0.035 on the worst text). The whole grid needs about
    # 650 measurements there (two calls): mean scoring at three thresholds, as most layers of the
    # 32K plan chose, fits one
    if [ "$ns" -gt 119000 ]; then
      texts=(--text stdlib_docs,copy_clauses) budget=${3:-0.05} heldout=stdlib_source,copy_log
      grid=(--thresholds "${5:-0.9,0.95,0.98}" --scorings "${4:-mean}")
    elif [ -n "${4:-}" ]; then
      grid=(--scorings "$4")
    fi
    # a run cut off by the call's limit resumes from its progress file (kept here as .gg/FILE.progress.json
    # and carried: the dense logits are recomputed, the measured layers are not)
    if [ -f ".gg/$file.progress.json" ]; then cp ".gg/$file.progress.json" "$out/$file.progress.json"; fi
    timeout 570 python3 -m sparseflow calibrate "$SPARSEFLOW_SMOLLM2_GGUF" --method pbs --kl-budget "$budget" \
      --tokens "$ns" --rope-scaling "yarn:auto:$ns" --cost time "${texts[@]}" "${grid[@]}" --heldout-text "$heldout" \
      --out "$out/$file" 2>&1 | grep -v -i warn | grep -v "Converting\|Loading" | tail -30 || true
    rm -rf "$out/$file.cache"  # the dense logits: too large to come back
    ;;
  frontier_plan)
    smollm2_env
    timeout 570 python3 benchmarks/frontier.py --ns "${3:-32768}" --estimates sampled_rows --thresholds 0.98 \
      --extra "smollm2:pbs,$2:pbs" --json "$out/frontier_smollm2_plan_${3:-32768}_${gpu}.json" \
      2>&1 | grep -v -i warn | tail -20
    ;;
  moments_cost)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/methods/pbs/test_pbs_moments.py tests/methods/pbs/test_pbs_moments_precision.py 2>&1 | tail -3 || true
    for heads in 9,3,64 4,1,256; do
      timeout 100 python3 benchmarks/check_pbs_estimate_cuda.py --check-n 4096 --strides 8 --time-n 32768,131072 \
        --time-scorings mean,moments,moments:ieee --heads "$heads" --json "$out/pbs_estimate_moments_${heads//,/_}_${gpu}.json" \
        2>&1 | grep -v "other tiles\|^check" | tail -6 || true
    done
    ;;
  moments_profile)
    timeout 200 python3 benchmarks/studies/pbs_moments_profile.py --n "${2:-32768}" --heads 9,3,64 \
      --json "$out/pbs_moments_profile_${2:-32768}_${gpu}.json" 2>&1 | grep -v -i warn | tail -34
    ;;
  moments_frontier)
    smollm2_env
    ns=${2:-32768}
    timeout 560 python3 benchmarks/frontier.py --ns "$ns" --estimates mean,moments --thresholds 0.9,0.95,0.98 \
      --extra smollm2:pbs --json "$out/frontier_smollm2_moments_${ns}_${gpu}.json" 2>&1 | grep -v -i warn | tail -20
    ;;
  pisa_profile)
    ns=${2:-262144}
    timeout 300 python3 benchmarks/studies/pisa_select_profile.py --n "$ns" --walks leaf_pairs,per_token,tiled \
      --scores bf16 --json "$out/pisa_select_profile_${ns}_${gpu}.json" 2>&1 | grep -v -i warn || true
    # SmolLM2's shape at 32K, where the end-to-end bar is BSA's time: the scan walk beside BSA's scan
    timeout 120 python3 benchmarks/studies/pisa_select_profile.py --n 32768 --heads 9,3,64 --walks scan,bsa \
      --scores fp32 --json "$out/pisa_select_profile_32768_smollm2_${gpu}.json" 2>&1 | grep -v -i warn || true
    ;;
  pisa_scan_profile)
    # SmolLM2's heads: the scan's kernels by time, heads "auto" (the loop for a group of 3) beside
    # "packed", fp32 and bf16 at 32K and fp32 at 8K, with BSA's bf16 scan of the same shape
    for ns in 32768:bf16 32768:fp32 8192:fp32; do
      for heads in auto packed; do
        walks=scan; [ $heads = auto ] && walks=scan,bsa
        timeout 100 python3 benchmarks/studies/pisa_select_profile.py --n "${ns%%:*}" --heads 9,3,64 --walks $walks \
          --scores "${ns##*:}" --scan-launch heads=$heads \
          --json "$out/pisa_select_profile_${ns%%:*}_smollm2_${ns##*:}_heads_${heads}_${gpu}.json" 2>&1 | grep -v -i warn | head -24 || true
      done
    done
    ;;
  pisa_rows)
    timeout 200 python3 benchmarks/studies/pisa_select_rows.py --json "$out/pisa_select_rows_${gpu}.json" \
      2>&1 | grep -v -i warn || true
    timeout 150 python3 benchmarks/studies/pisa_select_profile.py --n 262144 --walks leaf_pairs --scores bf16 \
      --json "$out/pisa_select_profile_262144_${gpu}.json" 2>&1 | grep -v -i warn | head -8 || true
    timeout 200 python3 benchmarks/studies/pisa_walk_precision.py --walks leaf_pairs --scores fp32,bf16,tf32 \
      --ns 65536,262144 --check-rows 64 --json "$out/pisa_walk_leaf_pairs_${gpu}.json" 2>&1 | tail -6 || true
    ;;
  selection_rule)
    smollm2_env
    timeout 570 python3 benchmarks/studies/pbs_selection_rule.py --device cuda --n "${2:-32768}" --strides 16,32 --moments \
      --json "$out/pbs_selection_rule_${2:-32768}_${gpu}.json" 2>&1 | grep -v -i warn | grep "^|\|layers" | tail -60
    ;;
  *)
    echo "usage: $0 first_call | gemma8k | gemma_profile32k | gemma32k | window_launch | estimate_cost | pisa_scores | pisa_walks | pisa_train | windows | reduce_overhead | pisa_decode | pisa_e2e [NS [TUNING]] | pisa_real_layers | split_smollm2 | stash_smollm2 K | frontier [NS] | calibrate [NS [BUDGET [SCORINGS [THRESHOLDS]]]] | frontier_plan PLAN [NS] | selection_rule [NS] | moments_cost | moments_frontier [NS] | moments_profile [NS] | pisa_tests | pisa_regs | pisa_rows | pisa_scan_profile | pisa_profile [NS]" >&2
    exit 2
    ;;
esac
