#!/usr/bin/env bash
# On a machine with a CUDA GPU and its own torch (no registries needed): checks the tools, builds peagle from source,
# checks the build, runs the C++ CUDA tests (where gtest exists), cuda_tests/, compute-sanitizer memcheck and racecheck
# over a small case of every kernel, and the GPU benchmarks. Every stage has a time limit; the summary is printed on
# exit whatever happens (a stage timing out, a failed build, Ctrl-C), and the logs stay in $OUT.
#   bash cuda_tests/run_gpu.sh                       (about 5 minutes on an H200; OUT=dir, default build/gpu-run)
#   PEAGLE_GPU_TIMINGS=1 bash cuda_tests/run_gpu.sh  (also the long timing cases and the side-by-side comparisons with
#                                                     the public peers installed here: benchmarks/bench_peers_cuda.py;
#                                                     pure-Python peers staged by scripts/stage_peers.py in
#                                                     build/peers/site join them)
#   PEAGLE_GPU_MUTATION=1 PEAGLE_GPU_BUDGET=1200 bash cuda_tests/run_gpu.sh
#       (also the mutation check, outside the default budget: cuda_tests/mutation_check.sh applies a deliberate
#       off-by-one to the verification walk in a scratch copy, builds it and expects test_tree_verify_cuda.py to
#       fail; it can also run on its own, after or without this script)
# The whole run stays within PEAGLE_GPU_BUDGET seconds (default 540): each stage gets at most what is left, and a
# stage that no longer fits is recorded as not run. summary.txt in $OUT is rewritten after every stage, so even a kill
# from outside leaves the summary so far. Exits non-zero when any stage failed, timed out or did not fit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu-run}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
START=$(date +%s)
BUDGET=${PEAGLE_GPU_BUDGET:-540}
FAILED=0
declare -a NAMES RESULTS

record() {
  NAMES+=("$1")
  RESULTS+=("$2")
  summary >"$OUT/summary.txt" 2>&1
}

summary() {
  echo
  echo "==================== peagle GPU summary ($(($(date +%s) - START)) s, logs in $OUT) ===================="
  [ -f "$OUT/gpu.txt" ] && cat "$OUT/gpu.txt"
  for i in "${!NAMES[@]}"; do printf '%-36s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
  echo "result: $([ "$FAILED" = 0 ] && echo "all stages passed" || echo "FAILED")"
}
finish() {
  summary 2>&1 | tee "$OUT/summary.txt" >&2
  if [ -s "$OUT/bench_gpu.json" ]; then
    timeout 60 "$PY" benchmarks/report.py "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_report.txt" >&2
  fi
  if [ -s "$OUT/bench_peers.json" ]; then
    timeout 60 "$PY" benchmarks/report.py "$OUT/bench_peers.json" 2>&1 | tee "$OUT/bench_peers_report.txt" >&2
  fi
  [ -s "$OUT/bench_peers.md" ] && cat "$OUT/bench_peers.md" >&2
  exit "$FAILED"
}
trap finish EXIT
trap 'record "interrupted" "FAILED (signal)"; FAILED=1; exit' INT TERM

# stage NAME SECONDS LOG COMMAND...: runs COMMAND under a time limit (SECONDS, or what is left of the budget less 20 s
# for the summary), its output in $OUT/LOG, and records the outcome.
stage() {
  local name=$1 limit=$2 log=$OUT/$3 t0 rc left
  shift 3
  t0=$(date +%s)
  left=$((BUDGET - (t0 - START) - 20))
  if [ "$left" -lt 15 ]; then
    record "$name" "NOT RUN (the ${BUDGET} s budget is spent)"
    FAILED=1
    return 1
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "---- $name (limit ${limit} s, log $log)" >&2
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" = 0 ]; then
    record "$name" "ok in $(($(date +%s) - t0)) s"
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    record "$name" "TIMED OUT after $limit s (see $log)"
    FAILED=1
  else
    record "$name" "FAILED, exit $rc (see $log)"
    FAILED=1
    tail -25 "$log" >&2
  fi
  return "$rc"
}

# The last line of a pytest log that counts tests (passed/failed/skipped/errors).
pytest_counts() { grep -E "[0-9]+ (passed|failed|error|skipped)" "$1" | tail -1; }

preflight() {
  local missing=()
  timeout 60 "$PY" -c 'import torch, pytest, numpy' || missing+=("python packages torch/pytest/numpy")
  timeout 60 "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || missing+=("a CUDA device for torch")
  [ -x "$CUDA_HOME/bin/nvcc" ] || command -v nvcc >/dev/null || missing+=("nvcc (CUDA_HOME=$CUDA_HOME)")
  command -v ninja >/dev/null || "$PY" -c 'import ninja, os, sys; sys.exit(0 if os.path.exists(
      os.path.join(ninja.BIN_DIR, "ninja")) else 1)' 2>/dev/null || missing+=("the ninja binary")
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "missing: ${missing[*]}"
    return 1
  fi
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      "capability", torch.cuda.get_device_capability())'
  "$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")" --version | tail -1
}

if ! preflight >"$OUT/preflight.log" 2>&1; then
  record "preflight (tools, device)" "FAILED: $(grep '^missing' "$OUT/preflight.log")"
  FAILED=1
  exit
fi
grep -v "^missing" "$OUT/preflight.log" >"$OUT/gpu.txt"
# Ninja from the pip package when there is no system binary (torch's BuildExtension needs it on PATH).
command -v ninja >/dev/null || PATH="$("$PY" -c 'import ninja; print(ninja.BIN_DIR)'):$PATH"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability()
print(f"{m}.{n}" + ("a" if m == 9 else ""))')}

if ! stage "build (archs $TORCH_CUDA_ARCH_LIST)" 300 build.log "$PY" setup.py build_ext --inplace; then exit; fi
# Without the CUTLASS / CuTe headers the tensor-core paths are not built and their tests would skip: carry
# build/cutlass (scripts/stage_cutlass.py) or set PEAGLE_CUTLASS_INCLUDE.
CUTLASS_LINE=$(grep -m1 "^peagle: CUTLASS headers: " "$OUT/build.log")
if [ -n "$CUTLASS_LINE" ] && [[ "$CUTLASS_LINE" != *"none ("* ]]; then
  export PEAGLE_EXPECT_CUTLASS=1
  record "  CUTLASS" "${CUTLASS_LINE#peagle: CUTLASS headers: }"
else
  record "  CUTLASS" "FAILED: no headers, tensor-core paths not built (carry build/cutlass: scripts/stage_cutlass.py)"
  FAILED=1
fi
stage "check_cuda_build.py" 60 check_build.log "$PY" scripts/check_cuda_build.py "$ROOT" &&
  record "  kernels" "$(grep -oE "^[0-9]+ (ops with CUDA kernels|host fallbacks)" "$OUT/check_build.log" | paste -sd,)"
# Device graph launch must be on: where it is not, every graph-chain test skips and the run would still pass.
stage "device graph launch available" 60 device_launch.log "$PY" -c 'import sys, torch, peagle
from peagle.decode.harness.graphs import device_launch_available
ok = torch.ops.peagle.graph_chain_available() and device_launch_available("cuda")
print("graph_chain_available and device_launch_available:", ok, "| allocator", torch.cuda.get_allocator_backend())
sys.exit(0 if ok else 1)'

if command -v cmake >/dev/null && [ -f /usr/include/gtest/gtest.h ]; then
  stage "ctest (C++ and C++ CUDA)" 150 ctest.log bash -c "cmake -S . -B build/gpu-cmake -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES=native && cmake --build build/gpu-cmake -j $MAX_JOBS && \
    cd build/gpu-cmake && ctest --output-on-failure"
else
  record "ctest" "not run (no cmake or no gtest headers here)"
fi

# Each test file in a pytest process of its own, PEAGLE_GPU_TEST_JOBS (default 6) at a time: a file that crashes its
# process (the first GPU run lost 88% of the suite to one segfault) or fails to import costs that file only. Logs and
# JUnit files per test file in $OUT/cuda_tests/; cuda_tests.log lists each file's outcome and pytest's last line.
run_cuda_test_files() {
  local dir=$OUT/cuda_tests
  rm -rf "$dir" && mkdir -p "$dir"
  # shellcheck disable=SC2016  # expanded by the inner bash
  printf '%s\n' cuda_tests/test_*.py | xargs -P "${PEAGLE_GPU_TEST_JOBS:-6}" -I{} env PY="$PY" DIR="$dir" bash -c '
    name=$(basename {} .py)
    "$PY" -m pytest {} -q -p no:cacheprovider -rfE --junitxml "$DIR/$name.xml" >"$DIR/$name.log" 2>&1
    rc=$?
    counts=$(grep -E "[0-9]+ (passed|failed|error|skipped)" "$DIR/$name.log" | tail -1)
    echo "$name exit $rc: ${counts:-no counts (crashed: see cuda_tests/$name.log)}" >"$DIR/$name.result"'
  cat "$dir"/*.result
  ! grep -qv " exit 0: " "$dir"/*.result
}
export -f run_cuda_test_files  # stage runs it under timeout, in a bash of its own
stage "cuda_tests" 300 cuda_tests.log env PY="$PY" OUT="$OUT" bash -c run_cuda_test_files
[ -f "$OUT/cuda_tests.log" ] &&
  record "  cuda_tests files" "$(grep -c " exit 0: " "$OUT/cuda_tests.log") of $(grep -c " exit " "$OUT/cuda_tests.log") passed$(
    grep -v " exit 0: " "$OUT/cuda_tests.log" | grep " exit " | sed 's/:.*//; s/^/; FAILED /' | tr -d '\n')"

SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
if [ -x "$SANITIZER" ]; then
  # No caching allocator: memcheck then sees each tensor's own allocation bounds. The graph chain cannot run that way
  # (uncached cudaMalloc / cudaFree are illegal inside a CUDA graph capture), so it runs on its own, under memcheck
  # with the caching allocator (racecheck of device-launched graphs is not documented as supported).
  for tool in memcheck racecheck; do
    stage "compute-sanitizer $tool" 90 "sanitizer_$tool.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$SANITIZER" --tool "$tool" --error-exitcode 3 "$PY" cuda_tests/sanitizer_cases.py cuda --without-graph-chain
  done
  stage "compute-sanitizer graph chain" 60 sanitizer_graph_chain.log \
    "$SANITIZER" --tool memcheck --error-exitcode 3 "$PY" cuda_tests/sanitizer_cases.py cuda --graph-chain-only
else
  record "compute-sanitizer" "not run (no compute-sanitizer here)"
fi

stage "GPU benchmarks" 120 bench.log "$PY" -m pytest benchmarks -q -p no:cacheprovider -k cuda \
  --ignore benchmarks/bench_peers_cuda.py --benchmark-json "$OUT/bench_gpu.json"
[ -f "$OUT/bench.log" ] && record "  benchmark counts" "$(pytest_counts "$OUT/bench.log")"

# Side by side with the public kernels installed here (flashinfer, vLLM, FLA, speculators; torch's create_block_mask is
# always there): opt-in with the other timing cases (flashinfer JIT-compiles its kernels and each N compiles
# create_block_mask once, hence the longer limit). A peer that is not installed is a skip, named in the log and in
# bench_peers.md. Pure-Python peers staged by scripts/stage_peers.py (carry build/peers) go on this stage's PYTHONPATH.
PEERS_SITE=${PEAGLE_PEERS_SITE:-$ROOT/build/peers/site}
case "${PEAGLE_GPU_TIMINGS:-0}" in
  "" | 0) record "GPU peer benchmarks" "not run (opt-in: PEAGLE_GPU_TIMINGS=1)" ;;
  *)
    PEERS_PATH=$PYTHONPATH STAGED="none (scripts/stage_peers.py, carry build/peers)"
    if [ -f "$PEERS_SITE/STAGED.txt" ]; then
      PEERS_PATH=$PEERS_SITE:$PYTHONPATH STAGED=$(tr '\n' ' ' <"$PEERS_SITE/STAGED.txt")
    fi
    stage "GPU peer benchmarks" 420 bench_peers.log env PEAGLE_PEERS_SUMMARY="$OUT/bench_peers.md" \
      PYTHONPATH="$PEERS_PATH" \
      "$PY" -m pytest benchmarks/bench_peers_cuda.py -q -rs -p no:cacheprovider --benchmark-json "$OUT/bench_peers.json"
    record "  staged peers" "$STAGED"
    [ -f "$OUT/bench_peers.log" ] && record "  peer benchmark counts" "$(pytest_counts "$OUT/bench_peers.log")"
    ;;
esac

# Opt-in (a second full build): the deliberately wrong kernel must fail cuda_tests.
if [ "${PEAGLE_GPU_MUTATION:-0}" = 1 ]; then
  rm -f "$OUT/mutation/result.txt"
  stage "mutation check (opt-in)" 600 mutation.log env OUT="$OUT" bash cuda_tests/mutation_check.sh
  [ -f "$OUT/mutation/result.txt" ] && record "  mutation" "$(cat "$OUT/mutation/result.txt")"
fi
