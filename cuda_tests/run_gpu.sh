#!/usr/bin/env bash
# On a machine with a CUDA GPU and its own torch (no registries needed): builds peagle from source, runs the C++ CUDA
# tests, cuda_tests/ and the GPU benchmarks, and prints a summary table last. Target: well under 8 minutes.
#   bash cuda_tests/run_gpu.sh            (OUT=dir keeps the logs and JSON there; default build/gpu-run)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/build/gpu-run}
mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}" + ("a" if m == 9 else ""))')}
command -v ninja >/dev/null || "$PY" -c "import ninja" 2>/dev/null || export PEAGLE_NO_DLINK=1
declare -a names results
record() { names+=("$1"); results+=("$2"); }
start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"

t0=$(date +%s)
if "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1; then
  record "build (archs $TORCH_CUDA_ARCH_LIST)" "ok in $(($(date +%s) - t0)) s"
else
  tail -40 "$OUT/build.log"
  record "build" "FAILED (see $OUT/build.log)"
fi

if command -v cmake >/dev/null && [ -f /usr/include/gtest/gtest.h ]; then
  if cmake -S . -B build/gpu-cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=native >"$OUT/cmake.log" 2>&1 &&
    cmake --build build/gpu-cmake -j "$MAX_JOBS" >>"$OUT/cmake.log" 2>&1 &&
    (cd build/gpu-cmake && ctest --output-on-failure >"$OUT/ctest.log" 2>&1); then
    record "ctest (C++ and C++ CUDA)" "$(grep 'tests passed' "$OUT/ctest.log")"
  else
    record "ctest (C++ and C++ CUDA)" "FAILED (see $OUT/cmake.log, $OUT/ctest.log)"
  fi
else
  record "ctest" "not run (no cmake or gtest headers on this machine)"
fi

"$PY" -m pytest cuda_tests -q -p no:cacheprovider --junitxml "$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.log" | tail -15
record "cuda_tests" "$(tail -1 "$OUT/cuda_tests.log")"

"$PY" -m pytest benchmarks -q -p no:cacheprovider -k cuda --benchmark-json "$OUT/bench_gpu.json" >"$OUT/bench.log" 2>&1
record "GPU benchmarks" "$(tail -1 "$OUT/bench.log")"

echo
echo "==================== peagle GPU summary ($(($(date +%s) - start)) s) ===================="
cat "$OUT/gpu.txt"
for i in "${!names[@]}"; do printf '%-32s %s\n' "${names[$i]}" "${results[$i]}"; done
[ -s "$OUT/bench_gpu.json" ] && "$PY" benchmarks/report.py "$OUT/bench_gpu.json"
