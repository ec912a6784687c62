#!/usr/bin/env bash
# Everything that needs the GPU, in one call from the repository root: the kernels built for this GPU, the GPU
# test suite, the benchmarks (JSON), a bit-for-bit comparison with the previous code (when .old/base holds it)
# and the notebooks executed; compute-sanitizer on request. Output goes to the terminal and OUTDIR/log.txt;
# results are laid out as in the repository, to be copied back: OUTDIR/bench/results/*.json and
# OUTDIR/notebooks/*.ipynb (one file per benchmark and per notebook).
#
# Usage: dev/gpu_check.sh OUTDIR [PART ...]
#   parts: build tests (the GPU test files; the CPU tests, NVRTC compiles included, run in CI) bench same_bits
#          notebooks (the default), or single benchmarks rope fp32 tf32 bf16,
#          varlen (bench varlen-attention, every precision) and long (bench attention-long, bf16 and tf32),
#          and sanitize (memcheck + racecheck) and racecheck-heuristic (racecheck with cuBLAS's heuristic kernels)
# HOLD=0 passes --no-hold-host to every benchmark (the flush alone; by default the GPU is held busy for each
# call's host issue time).
# Notebooks run through nbclient + ipykernel, installed from .whl/ (see dev/README.md) when that folder exists.
set -uo pipefail
out=${1:?usage: dev/gpu_check.sh OUTDIR [PART ...]}
shift
parts=${*:-build tests bench same_bits notebooks}
parts=${parts//bench/rope fp32 tf32 bf16}
mkdir -p "$out/bench/results" "$out/notebooks"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
hold=()
[ "${HOLD:-1}" = 0 ] && hold=(--no-hold-host)
log=$out/log.txt
summary=()

# run PART TIMEOUT COMMAND...: the command's output into the terminal and the log, its exit status recorded
run() {
  local part=$1 limit=$2
  shift 2
  echo "== $part: $* ($(date -u +%T))" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=$?
  echo "== $part exit $rc" | tee -a "$log"
  summary+=("$part exit $rc")
}

notebook_env() {  # nbclient and ipykernel are not in the GPU image: install the carried wheels once
  [ -n "${notebook_env_done:-}" ] && return 0
  notebook_env_done=1
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tee -a "$log" \
      && export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
}

echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)" | tee -a "$log"
for part in $parts; do
  case $part in
    build)  # every kernel module compiled for this GPU (NVRTC, into CuPy's cache) and each kernel called once
      python3 -c 'import sys, cupy, cupy_rope; print("python", sys.version.split()[0], "cupy", cupy.__version__,
        "cupy_rope", cupy_rope.__version__, "sm", cupy.cuda.Device().compute_capability)' 2>&1 | tee -a "$log"
      run build 300 python3 dev/sanitize_case.py ;;
    tests) run tests 420 python3 -m pytest -q -rs -p no:cacheprovider tests/test_*_gpu.py ;;  # the rest: CI
    rope) run rope 300 python3 -m cupy_rope bench rope "${hold[@]}" --out "$out/bench/results/rope_2d_backward.json" ;;
    fp32|tf32|bf16) run "$part" 300 python3 -m cupy_rope bench attention --precision "$part" "${hold[@]}" \
                      --out "$out/bench/results/vision_attention_backward_$part.json" ;;
    varlen) run varlen 500 python3 -m cupy_rope bench varlen-attention --precision all "${hold[@]}" \
              --out "$out/bench/results" ;;
    long) run long 500 python3 -m cupy_rope bench attention-long --precision all "${hold[@]}" \
            --out "$out/bench/results" ;;
    same_bits)
      if [ -d .old/base ]; then
        run same_bits 300 python3 dev/same_bits.py diff --path .old/base --module cupy_rope_base
      else
        echo "== same_bits: no .old/base here (the previous tree, git-ignored): skipped" | tee -a "$log"
      fi ;;
    notebooks)
      notebook_env
      run notebooks 600 python3 dev/run_notebooks.py --timeout 300 --out "$out/notebooks" notebooks/*.ipynb ;;
    sanitize)
      for tool in memcheck racecheck; do
        run "sanitize-$tool" 150 compute-sanitizer --tool $tool --print-limit 20 python3 dev/sanitize_case.py
      done ;;
    racecheck-heuristic)
      run racecheck-heuristic 150 compute-sanitizer --tool racecheck --print-limit 20 \
        python3 dev/sanitize_case.py --gemm-heuristic ;;
    *) echo "== unknown part $part (parts: build tests bench rope fp32 tf32 bf16 varlen long same_bits notebooks" \
            "sanitize racecheck-heuristic)" | tee -a "$log"; summary+=("$part unknown") ;;
  esac
done
echo "== summary: ${summary[*]/%/;}" | tee -a "$log"
for s in "${summary[@]}"; do
  [[ $s == *" exit 0" ]] || exit 1
done
