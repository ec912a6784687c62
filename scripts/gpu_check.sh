#!/usr/bin/env bash
# Everything that needs the GPU: the GPU test suite, compute-sanitizer on small calls of every kernel, the
# benchmarks (JSON into OUTDIR) and the notebooks (executed copies into OUTDIR).
# Usage: scripts/gpu_check.sh OUTDIR [STAGE ...]
#   stages: tests sanitize racecheck-heuristic rope tf32 bf16 fp32 notebooks (default all)
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [STAGE ...]}
shift
stages=${*:-tests sanitize racecheck-heuristic rope tf32 bf16 fp32 notebooks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log=$out/log.txt
echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)" >> "$log"
for st in $stages; do
  echo "== stage $st ($(date -u +%T))" >> "$log"
  case $st in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider tests >> "$log" 2>&1 ;;
    sanitize)
      for tool in memcheck racecheck; do
        echo "-- compute-sanitizer --tool $tool" >> "$log"
        timeout 150 compute-sanitizer --tool $tool --print-limit 20 python3 scripts/sanitize_case.py 2>&1 | tail -n 5 >> "$log"
      done ;;
    racecheck-heuristic)  # the same calls with cuBLAS's heuristic kernels (no autotuned choices)
      echo "-- compute-sanitizer --tool racecheck (cuBLAS heuristic kernels)" >> "$log"
      timeout 150 compute-sanitizer --tool racecheck --print-limit 20 python3 scripts/sanitize_case.py --gemm-heuristic \
        2>&1 | tail -n 5 >> "$log" ;;
    rope) timeout 300 python3 -m cupy_rope bench rope --out "$out/rope_2d_backward.json" >> "$log" 2>&1 ;;
    tf32|bf16|fp32) timeout 300 python3 -m cupy_rope bench attention --precision $st \
                      --out "$out/vision_attention_backward_$st.json" >> "$log" 2>&1 ;;
    notebooks)
      for nb in notebooks/*.ipynb; do
        timeout 300 python3 scripts/run_notebook.py "$nb" "$out/$(basename "$nb")" >> "$log" 2>&1
      done ;;
  esac
  echo "   stage $st exit $?" >> "$log"
done
grep -E "^== |exit [0-9]|passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|^mean|FAILED|Error|error" "$log" | tail -n 60
