#!/usr/bin/env bash
# Old main against new main, back to back on one machine: each headline benchmark runs in tree A,
# then in tree B, $ROUNDS times (default 2: A B A B, so drift of the machine falls on both), each
# from its own folder with its own benchmark script. JSON lines go to $OUT/ab_<tree>.jsonl, logs
# to $OUT/ab.log.
# Usage: benchmarks/ab_trees.sh TREE_A TREE_B PHASE...
#   phases: decode (batch 1, default options), compiled (batch 1, compile_decode), long
#   (16k context, fp16/q8/q4, batch 1 and 32; long-q4: q4 only), throughput (256 x 512 -> 128), shared (shared
#   document), host (host step, 256 jobs, CUDA)
# Print the comparison with: python3 benchmarks/ab_report.py $OUT/ab_A.jsonl $OUT/ab_B.jsonl
set -u
A=$1 B=$2; shift 2
OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: each run writes its JSON lines from inside its tree
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
bench() {  # bench LIMIT ARGS...: the same command in A then B, ROUNDS times
  local limit=$1; shift
  local trees=()
  for _ in $(seq "$ROUNDS"); do trees+=("$A" "$B"); done
  for tree in "${trees[@]}"; do
    local name; name=$(basename "$tree")
    echo "=== $(date +%T) $name: $*" | tee -a "$OUT/ab.log"
    (cd "$tree" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
      DYNGEN_BENCH_OUT="$OUT/ab_$name.jsonl" timeout "$limit" $PY "$@") 2>&1 \
      | grep -v '^\[transformers\]' | tail -n 40 >> "$OUT/ab.log"
    echo "=== exit ${PIPESTATUS[0]}" >> "$OUT/ab.log"
  done
}
for phase in "$@"; do
  case $phase in
    decode) bench 150 benchmarks/decode_batch1.py --no-hf --no-compile --new-tokens 128 ;;
    compiled) bench 200 benchmarks/decode_batch1.py --compiled-only --new-tokens 128 ;;
    long) bench 150 benchmarks/long_context.py --steps 10 ;;
    long-q4) bench 100 benchmarks/long_context.py --steps 10 --modes q4 ;;
    throughput) bench 150 benchmarks/throughput.py --engines dyngen ;;
    shared) bench 150 benchmarks/shared_document.py --skip-off --no-hf ;;
    host) bench 90 benchmarks/host_overhead.py --devices cuda --steps 60 ;;
    *) echo "unknown phase $phase" ;;
  esac
done
