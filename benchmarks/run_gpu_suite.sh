#!/usr/bin/env bash
# The GPU test and benchmark suite as run on the lent H200 (see BENCHMARKS.md).
# Usage: benchmarks/run_gpu_suite.sh PHASE...   phases: env tests smoke kernels decode
#        decode-compiled decode-fast long host host3 host-ngram spec-host load sampler throughput
#        shared shared-fast reliability. Logs and JSON lines go to $OUT (default ./bench_out). `tests` runs in 6
#        processes when pytest-xdist is importable (carry its wheel and execnet's in .whl/).
# Old main against new main: benchmarks/ab_trees.sh (BENCHMARKS.md, "Restructuring A/B").
# Every phase runs under its own time limit so one hang cannot eat the whole run.
set -u
OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
export DYNGEN_BENCH_OUT="$OUT/bench.jsonl" PYTHONUNBUFFERED=1 MAX_JOBS=16
PY=${PY:-python3}
run() {  # run LIMIT LOG CMD...
  local limit=$1 log=$2; shift 2
  echo "=== $(date +%T) $*" | tee -a "$OUT/$log"
  timeout "$limit" "$@" 2>&1 | grep -v '^\[transformers\]' | tee -a "$OUT/$log"
  echo "=== exit ${PIPESTATUS[0]} after $SECONDS s" | tee -a "$OUT/$log"
}
for phase in "$@"; do
  case $phase in
    env) run 60 env.log bash -c "nvidia-smi -L; $PY -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'" ;;
    tests)
      xdist=""; $PY -c "import xdist" 2>/dev/null && xdist="-n 6"
      # pyproject's addopts name a syrupy option, and the device image has no syrupy.
      run 420 tests.log $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib \
        $xdist -rs tests/gpu ;;
    smoke)
      run 60 smoke.log $PY benchmarks/decode_batch1.py --small --new-tokens 16 --no-hf
      run 60 smoke.log $PY benchmarks/long_context.py --small --context 2048 --batches 1,4 --steps 3
      run 60 smoke.log $PY benchmarks/throughput.py --small --prompts 8 --engines dyngen
      run 90 smoke.log $PY benchmarks/shared_document.py --small --questions 4 --skip-off --no-hf ;;
    kernels)  # the kernel microbenchmarks (benchmarks/kernels/), production defaults
      run 110 kernels.log $PY benchmarks/kernels/skinny_matmul.py
      run 100 kernels.log $PY benchmarks/kernels/fused_ops.py
      run 60 kernels.log $PY benchmarks/kernels/fp16_write.py
      run 150 kernels.log $PY benchmarks/kernels/quant_write.py
      run 120 kernels.log $PY benchmarks/kernels/decode_attention.py
      run 100 kernels.log $PY benchmarks/kernels/prefill_attention.py
      run 100 kernels.log $PY benchmarks/kernels/quant_decode.py
      run 100 kernels.log $PY benchmarks/kernels/cascade.py
      run 100 kernels.log $PY benchmarks/kernels/topk.py
      run 60 kernels.log $PY benchmarks/kernels/draw_graph.py ;;
    shared-fast) run 200 bench.log $PY benchmarks/shared_document.py --skip-off --no-hf ;;
    decode) run 240 bench.log $PY benchmarks/decode_batch1.py ;;
    decode-compiled) run 240 bench.log $PY benchmarks/decode_batch1.py --no-hf ;;
    decode-fast) run 150 bench.log $PY benchmarks/decode_batch1.py --compiled-only ;;
    long) run 150 bench.log $PY benchmarks/long_context.py ;;
    host) run 90 bench.log $PY benchmarks/host_overhead.py ;;
    host3)  # issue 24's figure: three runs of the CUDA host step, then each setting's median
      for _ in 1 2 3; do run 90 bench.log $PY benchmarks/host_overhead.py --devices cuda; done
      run 30 bench.log $PY -c "import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    d = json.loads(line)
    if d.get('benchmark') == 'host_overhead.step' and d.get('device') == 'cuda' \
            and not d.get('ngram'):
        runs.setdefault(d['sampling'], []).append(round(d['median_ms'], 3))
for sampling, values in runs.items():
    print('host step', sampling, 'last three runs', values[-3:], 'median',
          statistics.median(values[-3:]))" "$DYNGEN_BENCH_OUT" ;;
    host-ngram) run 120 bench.log $PY benchmarks/host_overhead.py --devices cuda --ngram \
      --sampling greedy ;;
    spec-host) run 300 bench.log $PY benchmarks/speculative_host.py --rounds 3 \
      --modes all,costed,off ;;
    load) run 240 bench.log $PY benchmarks/load_time.py ;;
    sampler) run 240 bench.log $PY benchmarks/sampler.py --repeats 7 ;;
    throughput) run 300 bench.log $PY benchmarks/throughput.py ;;
    shared) run 300 bench.log $PY benchmarks/shared_document.py ;;
    reliability) run 500 reliability.log $PY benchmarks/load.py ;;
    *) echo "unknown phase $phase" ;;
  esac
done
