#!/usr/bin/env bash
# Issue 16's measurements on a lent H200, one step a device call (each fits the 600 s limit).
#
#   bash benchmarks/device_issue16.sh prepare          # here, once: baseline modules, GGUF halves, wheels
#   then, on the device, in this order (carry what each step names):
#   gguf1    carry .device_in/gguf1,.whl     the GGUF's first half to /tmp/sf, the wheels to /tmp/site
#   layers   carry .device_in/gguf2,.device_in/ab
#            the second half joined, then the token-sparse attention beside the baseline commit's
#            on the same selections (8K and 32K), and PISA's layer on SmolLM2's real layers
#            3/15/27 at 8K beside the baseline's selection and attention (same inputs), with the
#            scan layouts and PDL
#   e2e      end to end at 8K, interleaved: PISA, BSA, PBS, the recipe (backend="triton") and PISA
#            with PDL against dense SDPA
#   compile  PISA's and BSA's fidelity at 8K (KL, top-1), and their sparseflow.compile in
#            reduce-overhead mode beside the converted path and compile(dense)
#   auto     backend="auto" against dense at 4K and 8K, interleaved
#   tests    the PISA, BSA, token-sparse and PDL GPU tests
#
# The GGUF steps share one warm machine (it stays warm 30 s after a call): run layers right
# after gguf1, and the later steps before it goes back. Results land in $OUT (the device's)
# or .device_out here; copy the ones quoted into benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=${BASE:-48042ea}  # the last commit whose PISA selection and attention the H200 timed
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
IN=.device_in
OUT=${OUT:-.device_out}
mkdir -p "$OUT"

device_env() {
    export SPARSEFLOW_SMOLLM2_GGUF=/tmp/sf/$GGUF_NAME HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site; fi
    if [ ! -f "$SPARSEFLOW_SMOLLM2_GGUF" ]; then
        if [ -f /tmp/sf/part1 ] && [ -f $IN/gguf2/part ]; then
            cat /tmp/sf/part1 $IN/gguf2/part > "$SPARSEFLOW_SMOLLM2_GGUF"
        else
            echo "no GGUF on this machine: run the gguf1 step, then this one carrying .device_in/gguf2" >&2
            exit 2
        fi
    fi
}

failed=0
run_logged() {  # run_logged NAME CMD...: the output to the terminal and $OUT/NAME.log; a failure is
    # reported and the step goes on to its next command (one call, several measurements)
    if ! "${@:2}" 2>&1 | tee "$OUT/$1.log"; then
        echo "FAILED: $1" >&2
        failed=1
    fi
}

case "${1:-}" in
prepare)
    mkdir -p $IN/ab $IN/gguf1 $IN/gguf2
    git show "$BASE:sparseflow/kernels/token_sparse_triton.py" > $IN/ab/token_sparse_triton.py
    for f in triton_select triton_select_scan; do
        git show "$BASE:sparseflow/methods/pisa/$f.py" > $IN/ab/$f.py
    done
    gguf=$(python -c "import sys; from sparseflow.checkpoints import smollm2_gguf; p = smollm2_gguf(); print(p or ''); sys.exit(not p)")
    half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
    head -c "$half" "$gguf" > $IN/gguf1/part
    tail -c +"$((half + 1))" "$gguf" > $IN/gguf2/part
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "gguf==$(python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    ls -l $IN/ab $IN/gguf1 $IN/gguf2 .whl
    ;;
gguf1)
    mkdir -p /tmp/sf /tmp/site
    cp $IN/gguf1/part /tmp/sf/part1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
    ;;
layers)
    device_env
    run_logged "token_sparse_vs_${BASE}_h200" python benchmarks/studies/token_sparse_schedule.py \
        --baseline $IN/ab/token_sparse_triton.py --ns 8192,32768 --ks 8 --parts attention \
        --json "$OUT/token_sparse_vs_${BASE}_h200.json"
    run_logged "pisa_layer_kernels_vs_${BASE}_h200" python benchmarks/studies/pisa_layer_kernels.py \
        --real 3,15,27 --old $IN/ab --pdl \
        --scan-launch "heads=loop;pair_unit=siblings;heads=loop,pair_unit=siblings" \
        --json "$OUT/pisa_layer_kernels_vs_${BASE}_h200.json"
    ;;
e2e)
    device_env
    run_logged e2e_triton_8k_h200 python benchmarks/auto_vs_dense.py --ns 8192 \
        --variants "pisa triton,bsa triton,pbs triton,recipe triton,pisa pdl" --json "$OUT/e2e_triton_8k_h200.json"
    ;;
compile)
    device_env
    run_logged e2e_pisa_bsa_compile_8k_h200 python benchmarks/e2e_prefill.py --ns 8192 --ropes plain \
        --settings pisa,bsa --paths converted,compile,compile_dense --compile-mode reduce-overhead \
        --json "$OUT/e2e_pisa_bsa_compile_8k_h200.json"
    ;;
auto)
    device_env
    run_logged e2e_auto_4k_8k_h200 python benchmarks/auto_vs_dense.py --ns 4096,8192 \
        --variants "pbs auto,pisa auto,bsa auto" --json "$OUT/e2e_auto_4k_8k_h200.json"
    ;;
tests)
    device_env
    run_logged gpu_tests_pisa_h200 python -m pytest -q -x -p no:cacheprovider tests/methods/pisa \
        tests/methods/test_pisa_bsa_triton.py tests/kernels
    ;;
*)
    sed -n '2,21p' "$0"
    exit 2
    ;;
esac
exit $failed
